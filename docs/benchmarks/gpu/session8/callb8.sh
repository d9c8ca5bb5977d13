#!/bin/bash
# Session 8, call B: a traced MoE decode at 4 GiB (where the host's time goes per sub-layer), then the
# suite's Slipstream rows again with prompts that share no cached prefix and the faster sampler (efce84e).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callb; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "sampler cost"
python3 - <<'PY'
import time, torch
from engine.generation import Sampler, SamplingParams
for V in (128256, 151936):
    l = torch.randn(V, dtype=torch.bfloat16)
    for tp in (1.0, 0.95):
        s = Sampler(SamplingParams(temperature=1.0, top_p=tp, seed=1)); [s(l) for _ in range(5)]
        t = time.perf_counter(); [s(l) for _ in range(50)]
        m = torch.multinomial(torch.softmax(l.float(), -1), 1)
        t2 = time.perf_counter(); [torch.multinomial(torch.softmax(l.float(), -1), 1) for _ in range(50)]
        print(f"vocab {V} top_p {tp}: sampler {(t2 - t) / 50 * 1e3:.2f} ms; softmax+multinomial {(time.perf_counter() - t2) / 50 * 1e3:.2f} ms")
PY
step "moe decode trace"
timeout 150 python3 -m engine.bench.decode_steps --shape qwen3-30b-a3b --budgets 4GiB --tokens 24 --profile-steps 3 --out $W/moe-trace 2>&1 | grep "==\|opened\|Error\|ms"
step "suite"
python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | tail -14
step pack
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
tar cJf $OUT/callb8.tar.xz -C $W .
