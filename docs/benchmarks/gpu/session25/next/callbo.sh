#!/bin/bash
# Session 25's next call, BO (written, not run; up to 9.5 min). Copy into carry/ with the profile (h200-profile.json).
# 0) The CUDA tests of what changed after session 25's last call (the staging ring running ahead, a prompt's
#    re-plan bringing in its step's plan, the tier's 256 MiB chunks) and of the host KV tier.
# 1) prefill_timeline at 8 GiB with the admissions listed (`store.set_resident`): the first 4096-token prompt's
#    activation took 142-204 ms in calls BJ and BL (kv._grow 19 ms, 55 small pool resizes 23 ms, the rest
#    not yet placed).
# 2) The suite's Llama rows with the host KV tier pinning piece by piece and stopping when a request starts
#    (call BM's timeline at 4 GiB: 512-token prompts 180-194 ms to the first token, 4096-token ones 245-254 ms,
#    against 209-222 and 286-287 in call BL; the table's rows are call BJ's, before the change).
# 3) The MoE rows at every budget, as far as the deadline lets them run.
# Then part_replace for each part (--archive session25 on the first) and the merge.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbo; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_host_kv.py \
  tests/engine/test_transfer_code.py tests/engine/test_oom_retry.py tests/engine/test_replan_first_plan.py \
  tests/engine/test_executor.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -8
step "prefill timeline, 8 GiB"
timeout 70 python3 -m engine.bench.prefill_timeline --shape llama3-8b --budgets 8GiB --runs 2 \
  --out $W/timeline > $W/timeline.log 2>&1; echo "rc=$?"
grep -v USDT $W/timeline.log | cut -c1-160 | head -50
step "llama3-8b rows"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-260)) \
  > $W/llama.log 2>&1; echo "rc=$?"; grep -h "slipstream llama3-8b\|opened" $W/llama.log | tail -4
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step "MoE rows"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/moe --deadline-epoch $((D-5)) \
  > $W/moe.log 2>&1; echo "rc=$?"; grep -h "slipstream qwen3\|opened\|Error" $W/moe.log | tail -4
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step pack
tar cJf $OUT/callbo.tar.xz -C $W .
