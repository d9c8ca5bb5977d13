#!/bin/bash
# Session 7, call B: routers beside CPU experts + spills that never pin in front of a prompt (new, the
# working tree) against HEAD cefe006 (old, carry/old), alternating processes on one lease: MoE decode at 4
# and 8 GiB; a traced 4096-token prefill at 4 GiB (new); then the suite's MoE rows (new).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callb; mkdir -p $W; R=$PWD
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { echo $(( D - $(date +%s) )); }
step tests
PYTHONPATH=/tmp/site:$R SLIPSTREAM_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider -x $TESTS 2>&1 | tail -4
for run in new1 old1 new2 old2; do
  step "moe $run"
  if [ ${run:0:3} = old ]; then cd $R/carry/old; export PYTHONPATH=/tmp/site:$R/carry/old; else cd $R; export PYTHONPATH=/tmp/site:$R; fi
  timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m engine.bench.decode_steps --shape qwen3-30b-a3b --budgets 4GiB,8GiB --tokens 64 --no-decode-traces --out $W/moe-$run 2>&1 | grep "==\|opened\|Error"
done
cd $R; export PYTHONPATH=/tmp/site:$R
step "llama prefill trace"
timeout $(( $(left) < 100 ? $(left) : 100 )) python3 -m engine.bench.decode_steps --budgets 4GiB --tokens 16 --no-decode-traces --prefill-trace 4096 --out $W/llama 2>&1 | grep "==\|opened\|Error"
step "suite moe"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | tail -8
step pack
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
tar cJf $OUT/callb.tar.xz -C $W .
