"""Session 11, call U: batched decode with the one-token kernel for a batch's decode tokens over VRAM KV
(attend_one_token_batch) against the padded SDPA with expanded heads it replaced, alternating in one
process (Llama-3-8B shape, 8 GiB: every layer's KV in VRAM)."""
import sys

from engine.bench.batch_throughput import run_streams
from engine.bench.gpu_common import open_shape
from engine.sharding.executor import Executor
from engine.units import parse_bytes

eng = open_shape("llama3-8b", parse_bytes(sys.argv[1]), n_ctx=512)
eng._ensure_kv_capacity(16 * 160)
real = Executor._one_token_kernel
run_streams(eng, 16, 64, 4, seed=97)
for rep in range(3):
    for on in (True, False):
        Executor._one_token_kernel = real if on else (lambda self, layer, segs, q: False)
        for b in (16, 4):
            r = run_streams(eng, b, 64, 32, seed=b + rep)
            print(f"one-token kernel {'on ' if on else 'off'} batch {b:2d}: {r['decode_aggregate_tokens_per_s']:.1f} t/s",
                  flush=True)
eng.close()
