#!/bin/bash
# Session 8, call D: one-token attention (up to its cache) and FFNs replayed from CUDA graphs. CUDA tests;
# then graphs on against off (SLIPSTREAM_CUDA_GRAPHS=0, the same code), alternating processes on one lease:
# Llama-3-8B decode at 4 GiB, the MoE shape (8 of 48 layers) at 4 GiB; then the suite's Slipstream rows
# with graphs on, if the tests passed.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/calld; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-540} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { echo $(( D - $(date +%s) )); }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 130 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py tests/engine/test_executor.py tests/engine/test_moe.py 2>&1 | tail -6 | tee $W/tests.log
ok=$(grep -c " passed" $W/tests.log); bad=$(grep -c "failed\|error" $W/tests.log)
for run in on1 off1 on2 off2; do
  step "llama $run"
  SLIPSTREAM_CUDA_GRAPHS=$([ ${run:0:2} = on ] && echo 1 || echo 0) timeout 70 python3 -m engine.bench.decode_steps --budgets 4GiB --tokens 32 --no-decode-traces --out $W/llama-$run 2>&1 | grep "==\|Error"
done
for run in on1 off1 on2 off2; do
  step "moe $run"
  SLIPSTREAM_CUDA_GRAPHS=$([ ${run:0:2} = on ] && echo 1 || echo 0) timeout 45 python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 4GiB --kinds auto --tokens 48 --out $W/moe-$run 2>&1 | grep "==\|Error\|resident/attn"
done
if [ "$ok" -ge 1 ] && [ "$bad" -eq 0 ]; then
  step suite
  python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | tail -12
  cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
fi
step pack
tar cJf $OUT/calld8.tar.xz -C $W .
