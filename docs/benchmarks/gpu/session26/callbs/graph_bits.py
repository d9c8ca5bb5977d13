"""Session 26 diagnostic (call BS): does a one-token sub-layer replayed from a CUDA graph give the bits its
eager run gives? The transfer-code test's schedule (random placements switched every 5 tokens, seed 11) on
the tiny llama3 model in bf16; every OneTokenGraphs.run also runs its function eagerly on the same input
and on a fresh copy of it (another address), and the outputs are compared bit for bit."""
import os
import random
import sys
from collections import Counter

import torch

os.environ.setdefault("SLIPSTREAM_TRANSFER_CODE_MIN", "0")
import engine  # noqa: E402
from engine.backends.torch_engine import TorchEngine  # noqa: E402
from engine.sharding import graphs as G  # noqa: E402
from tests.engine.test_executor import random_planset  # noqa: E402
from tests.engine.tiny_plans import all_cpu_planset, force_planset  # noqa: E402
from tests.tiny_models import tiny_model_cache  # noqa: E402

TorchEngine._make_planset = all_cpu_planset
TorchEngine._refine_in_background = lambda self: None
seen = Counter()
orig = G.OneTokenGraphs.run


def _tup(o):
    return o if isinstance(o, tuple) else (o,)


def _eq(a, b):
    return all(torch.equal(x, y) for x, y in zip(_tup(a), _tup(b)))


def run(self, kind, fn, w, x):
    captured = self._key(kind, w, x) in self._graphs
    out = orig(self, kind, fn, w, x)
    ref = tuple(t.clone() for t in _tup(out))
    same_x = fn(w, x)
    fresh = fn(w, x.clone())
    seen[(kind, "replay" if captured else "eager", x.data_ptr() % 256, _eq(ref, same_x), _eq(ref, fresh))] += 1
    return out


G.OneTokenGraphs.run = run
path = tiny_model_cache("llama3", dtype="bfloat16")
mode = sys.argv[1] if len(sys.argv) > 1 else "wrap"
if mode == "plain":
    G.OneTokenGraphs.run = orig
for code in (True, False, False):
    os.environ["SLIPSTREAM_TRANSFER_CODE"] = "1" if code else "0"
    eng = engine.open_model(path, device=os.environ.get("DEV", "cuda"), backend="torch", vram_budget="1GiB")
    rng = random.Random(11)
    force_planset(eng, random_planset(eng, rng, 2))
    got = []
    for i, ev in enumerate(eng.generate("the quick brown fox", max_new_tokens=24)):
        got.append(ev.token_id)
        if i % 5 == 2:
            force_planset(eng, random_planset(eng, rng, 1 + i % 3))
    st = eng.executor.graphs.stats() if eng.executor.graphs else {}
    eng.close()
    print(f"code={code} graphs={os.environ.get('SLIPSTREAM_CUDA_GRAPHS', '1')} tokens {got[-6:]} "
          f"captures {st.get('cuda_graph_captures')} replays {st.get('cuda_graph_replays')}")
print("kind, path, x address mod 256, replay==eager(same x), replay==eager(fresh x): count")
for k, n in sorted(seen.items(), key=str):
    print(" ", k, n)
