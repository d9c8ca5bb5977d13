#!/bin/bash
# Session 7, call A: GPU host costs in the estimator + routers beside CPU experts (new) against HEAD (old,
# carry/old), same lease: decode of the Llama-3-8B and Qwen3-30B-A3B shapes at 4 and 8 GiB; smollm2 at a
# huge budget (the new estimator's mixed plan against all resident); a 4096-token prefill trace (spill fix).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/calla; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { echo $(( D - $(date +%s) )); }
NEW=/tmp/site:$PWD; OLD=/tmp/site:$PWD/carry/old
step tests
PYTHONPATH=$NEW SLIPSTREAM_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider -x $TESTS 2>&1 | tail -6
step smollm2
PYTHONPATH=$NEW timeout 60 python3 - <<'PY' 2>&1 | tail -8
import statistics, sys
from engine.backends.torch_engine import TorchEngine
from engine.loading.random_init import random_model
from engine.bench.shapes import get_shape
from engine.bench.decode_steps import token_times
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
eng = TorchEngine(random_model(get_shape("smollm2-135m"), seed=0, name="smollm2"), device=dev,
                  vram_budget=60 << 30, n_ctx=2048, speculative=False)
for kind in ("auto", "gpu_only", "auto", "gpu_only"):
    eng.force_plan(kind)
    token_times(eng, "hello " * 20, 4)
    ms = statistics.median(token_times(eng, "hello " * 20, 48)[1:]) * 1e3
    t = eng.plan_report()["tiers"][0]
    print(kind, t["plan"], "predicted", round(t["predicted_ms"], 2), "measured", round(ms, 2), "ms")
PY
for who in new old; do
  P=$NEW; [ $who = old ] && P=$OLD
  step "llama $who"
  PYTHONPATH=$P timeout $(( $(left) < 110 ? $(left) : 110 )) python3 -m engine.bench.decode_steps --budgets 4GiB,8GiB --tokens 24 --no-decode-traces $( [ $who = new ] && echo --prefill-trace 4096 ) --out $W/llama-$who 2>&1 | grep "==\|opened\|Error"
done
for who in new old; do
  P=$NEW; [ $who = old ] && P=$OLD
  step "moe $who"
  PYTHONPATH=$P timeout $(( $(left) < 170 ? $(left) : 170 )) python3 -m engine.bench.decode_steps --shape qwen3-30b-a3b --budgets 4GiB,8GiB --tokens 24 --no-decode-traces --out $W/moe-$who 2>&1 | grep "==\|opened\|Error"
done
step pack
tar cJf $OUT/calla.tar.xz -C $W .
