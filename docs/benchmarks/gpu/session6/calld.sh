#!/bin/bash
# Session 6, call D: CUDA tests, native CPU attention A/B (decode), prefill trace, attention parts, suite rows.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/calld; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -x $TESTS 2>&1 | tail -15
step "decode native"
timeout 120 python3 -m engine.bench.decode_steps --budgets 4GiB --tokens 32 --prefill-trace 4096 --out $W/native 2>&1 | grep -v "^ " | grep -v "^|---" | tail -45
step "decode torch attention"
SLIPSTREAM_CPU_ATTENTION=torch timeout 100 python3 -m engine.bench.decode_steps --budgets 4GiB --tokens 32 --no-decode-traces --out $W/torchattn 2>&1 | grep "=="
step "attention parts"
for c in 256 2048; do timeout 40 python3 -m engine.bench.cpu_attention_parts --ctx $c --out $W/parts$c 2>&1 | tail -12; done
step suite
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/suite --deadline-epoch $D 2>&1 | tail -12
step pack
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
tar cJf $OUT/calld.tar.xz -C $W .
