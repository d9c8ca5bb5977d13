#!/bin/bash
# Session 29, call CH (up to 9.5 min). Copy into carry/ with the profile (h200-profile.json).
# Call CG's MoE 2 GiB row failed: a coded expert group's escape scatter (PyTorch copies the int32 index to
# int64, 20 MiB unbooked) ran out of memory under the allocator's cap, and every back-off met the same failed
# copy again until "out of memory even with nothing on the GPU". Fixed: escapes put in slices of 128 Ki (a
# 1 MiB index, booked with the ring), a failed copy empties its slot. 1) The MoE rows at 2, 4 and 8 GiB at the
# defaults (all MoE rows in the table predate the CPU matmul's prefetching). 2) The CUDA tests of the fix.
# Afterwards: part_replace --models qwen3-30b-a3b --budgets (the rows that came back), and the merge.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callch; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "MoE rows, 2, 4 and 8 GiB"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB,4GiB,8GiB --out $W/moe \
  --deadline-epoch $((D-140)) > $W/moe.log 2>&1; echo "rc=$?"
grep -h "slipstream qwen3\|opened\|Error\|retrying" $W/moe.log | cut -c1-300 | tail -6
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
left=$(( D - $(date +%s) ))
if [ $left -gt 40 ]; then
  step "CUDA tests ($left s left)"
  SLIPSTREAM_TEST_DEVICE=cuda timeout $(( left - 10 )) python3 -m pytest -q -p no:cacheprovider --tb=short \
    -o faulthandler_timeout=100 tests/engine/test_transfer_code.py tests/engine/test_oom_retry.py \
    tests/engine/test_moe_host_path.py > $OUT/tests-cuda.txt 2>&1
  echo "rc=$?"; grep "passed\|failed\|FAILED\|Timeout" $OUT/tests-cuda.txt | cut -c1-400 | tail -8
fi
step pack
tar cJf $OUT/callch.tar.xz -C $W .
