#!/bin/bash
# Session 8, call C: the GPU's norms as one PyTorch call (the working tree) against HEAD df791e6 (carry/old),
# alternating processes on one lease: CUDA tests, then decode of Llama-3-8B at 4 GiB and of the MoE shape
# (8 of 48 layers) at 4 GiB.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callc; mkdir -p $W; R=$PWD
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { echo $(( D - $(date +%s) )); }
step tests
PYTHONPATH=/tmp/site:$R SLIPSTREAM_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/engine/test_dense_blocks.py tests/engine/test_executor.py tests/engine/test_moe.py 2>&1 | tail -4
go() {   # go new|old label command...
  local which=$1; shift; local label=$1; shift
  if [ $which = old ]; then cd $R/carry/old; export PYTHONPATH=/tmp/site:$R/carry/old; else cd $R; export PYTHONPATH=/tmp/site:$R; fi
  step "$label"
  timeout $(( $(left) < 100 ? $(left) : 100 )) "$@" 2>&1 | grep "==\|opened\|Error\|median"
  cd $R
}
for run in new1 old1 new2 old2; do
  go ${run:0:3} "llama $run" python3 -m engine.bench.decode_steps --budgets 4GiB --tokens 48 --no-decode-traces --out $W/llama-$run
done
for run in new1 old1 new2 old2; do
  go ${run:0:3} "moe $run" python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 4GiB --kinds auto --tokens 48 --out $W/moe-$run
done
step pack
tar cJf $OUT/callc8.tar.xz -C $W .
