#!/bin/bash
# Session 28's next call, CG (written, not run; up to 9.5 min). Copy into carry/ with the profile (h200-profile.json).
# The suite's rows that still predate the CPU matmul's prefetching (on by default since session 27; call CD:
# the 4 GiB decode 15% faster with it in one engine), at the defaults: the Llama-3-8B shape at 2 and 8 GiB,
# then the MoE shape at 2 GiB; then, with time left, the engine's CUDA tests (session 27 call BZ's list).
# Afterwards: part_replace --models llama3-8b --budgets 2GiB,8GiB (--archive session28 on the first), the MoE
# rows with --models qwen3-30b-a3b --budgets 2GiB, and the merge.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callcg; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "llama3-8b rows, 2 and 8 GiB"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 2GiB,8GiB --out $W/llama \
  --deadline-epoch $((D-330)) > $W/llama.log 2>&1; echo "rc=$?"; grep -h "slipstream llama3-8b\|opened" $W/llama.log | tail -4
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step "MoE row, 2 GiB"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB --out $W/moe \
  --deadline-epoch $((D-150)) > $W/moe.log 2>&1; echo "rc=$?"; grep -h "slipstream qwen3\|opened\|Error" $W/moe.log | tail -4
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
left=$(( D - $(date +%s) ))
if [ $left -gt 60 ]; then
  step "CUDA tests ($left s left)"
  SLIPSTREAM_TEST_DEVICE=cuda timeout $(( left - 10 )) python3 -m pytest -q -p no:cacheprovider --tb=short \
    -o faulthandler_timeout=100 tests/engine/test_transfer_code.py tests/engine/test_host_kv.py \
    tests/engine/test_executor.py tests/engine/test_cuda_graphs.py tests/engine/test_oom_retry.py \
    tests/engine/test_replan_first_plan.py tests/engine/test_ffn_share.py tests/engine/test_vram_cap.py \
    tests/engine/test_fidelity.py tests/engine/test_moe.py tests/engine/test_moe_host_path.py \
    tests/engine/test_gguf_16bit.py tests/engine/test_vision_engine.py tests/engine/test_planner.py > $OUT/tests-cuda.txt 2>&1
  echo "rc=$?"; grep "passed\|failed\|FAILED\|Timeout" $OUT/tests-cuda.txt | cut -c1-400 | tail -8
fi
step pack
tar cJf $OUT/callcg.tar.xz -C $W .
