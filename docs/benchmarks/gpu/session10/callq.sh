#!/bin/bash
# Next call (written in session 10, not run): what session 10 wrote after its last call. CUDA tests (the
# one-call MoE layer for batched steps, the padded runs of GPU expert groups, the captured attention on by
# default); the CPU experts of batched steps (`moe_cpu_experts --batches`); MoE prompt steps (24 layers,
# 4 GiB, tiers 64/256/1024) under the auto (mixed) and gpu_only plans with the padded runs on against off
# (SLIPSTREAM_MOE_PADDED), alternating processes; then the MoE suite rows (batched rows with the new count).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callq; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-540} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_cuda_graphs.py tests/engine/test_moe_host_path.py tests/engine/test_executor.py tests/engine/test_host_kv.py tests/engine/test_moe.py 2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt; tail -6 $W/tests.txt
step experts
timeout 60 python3 -m engine.bench.moe_cpu_experts --batches 1,4,16 --out $W 2>&1 | grep "batch\|rror"
# (session 10 keeps a batch's routed experts in one native job up to 16 rows each; before, one expert of more
# than 4 rows sent the layer's experts to PyTorch one by one on an AMX host, as this run does again:)
SLIPSTREAM_NATIVE_MAX_ROWS=4 timeout 60 python3 -m engine.bench.moe_cpu_experts --batches 16 --out $W/rows4 2>&1 | grep "batch\|rror"
for run in on1 off1 on2 off2; do
  [ $(( $(date +%s) + 60 )) -gt $(( D - 200 )) ] && break
  step "moe prompt steps, padded runs $run"
  SLIPSTREAM_MOE_PADDED=$([ ${run:0:2} = on ] && echo 1 || echo 0) timeout 75 python3 -m engine.bench.planner_accuracy --shape qwen3-30b-a3b --layers 24 --budgets 4GiB --tiers 64,256,1024 --kinds dynamic,gpu_only --reps 2 --out $W/prompt-$run 2>&1 | grep "GiB\|rror"
done
step "moe suite"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -6
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callq.tar.xz -C $W .
