#!/bin/bash
# Session 26, call BO (up to 9.5 min). 0) The CUDA tests of the host KV tier and transfer coding, twice in two
# processes: call BR's run met test_placements_changing_mid_generation_keep_the_tokens_coded[llama3] failing
# again, the raw side's first run moving at the last token (the test now records each token's CUDA graph state).
# 1) The suite's Llama rows at every budget with session 25's later changes (host KV tier pinning piece by piece,
# stopping at a request's start; 256 MiB chunks; a prompt's re-plan bringing in its step's plan; the spill's
# copies on a thread; coded copies crossing into the ring ahead). 2) The MoE 2 GiB row, as far as the deadline
# lets it run. Then part_replace for each part (--archive session25 on the first) and the merge.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbo; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-555} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
for k in 1 2; do
  step "CUDA tests, process $k"
  SLIPSTREAM_TEST_DEVICE=cuda timeout 75 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_host_kv.py \
    tests/engine/test_transfer_code.py $( [ $k = 1 ] && echo tests/engine/test_oom_retry.py tests/engine/test_replan_first_plan.py ) \
    > $W/tests-$k.txt 2>&1
  grep -v "^  *File\|^$" $W/tests-$k.txt | grep "Failed\|passed\|failed\|FAILED" | cut -c1-1500 | tail -5
done
step "llama3-8b rows"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-190)) \
  > $W/llama.log 2>&1; echo "rc=$?"; grep -h "slipstream llama3-8b\|opened" $W/llama.log | cut -c1-200 | tail -4
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step "MoE 2 GiB row"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB --out $W/moe --deadline-epoch $((D-5)) \
  > $W/moe.log 2>&1; echo "rc=$?"; grep -h "slipstream qwen3\|opened\|Error" $W/moe.log | cut -c1-250 | tail -4
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe-2gib.json 2>/dev/null
step pack
tar cJf $OUT/callbo.tar.xz -C $W .
