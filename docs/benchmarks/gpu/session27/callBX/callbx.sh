#!/bin/bash
# Session 26's next call, BX (written, not run; about 9 min). Copy into carry/ with the profile (h200-profile.json).
# The decode tier streaming through one slot (written after session 26's last call: `planner.ONE_SLOT_TIERS`,
# on by default, SLIPSTREAM_ONE_SLOT_DECODE=0 off). The H200 profile prices the Llama-3-8B decode plans 1.4 /
# 1.9% faster at 4 / 8 GiB with one slot and another FFN resident (two slots kept at 2 GiB).
# 0) its CUDA tests (the executor switching slot counts between tiers, the planner's plans);
# 1) decode_runs with one slot off and on, in turns inside one engine (abba), Llama-3-8B at 4 GiB, then 8 GiB;
# 2) the suite's Llama 4 GiB row with it on (the table's row is session 26's call BO, before it).
# Then, if the decode pays: part_replace --models llama3-8b --budgets 4GiB --note "session 27 call BX"
# --archive session26, and the merge.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbx; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-545} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_executor.py \
  tests/engine/test_planner.py -k "own_slot or one_slot or placement" > $W/tests.txt 2>&1
grep "Failed\|passed\|failed" $W/tests.txt | cut -c1-600 | tail -4
for b in 4GiB 8GiB; do
  step "Llama-3-8B $b, one slot off/on"
  timeout 140 python3 -m engine.bench.decode_runs --shape llama3-8b --budget $b --runs 6 --tokens 48 \
    --one-slot-variants off,on --order abba --out $W/llama-$b > $W/llama-$b.log 2>&1; echo "rc=$?"
  grep "^|" $W/llama-$b.log | cut -c1-200 | head -9
done
step "suite row, Llama 4 GiB"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB --out $W/row --deadline-epoch $((D-5)) \
  > $W/row.log 2>&1; echo "rc=$?"; grep -h "slipstream llama3-8b\|opened" $W/row.log | cut -c1-200 | tail -3
cp $W/row/part-slipstream.json $OUT/part-slipstream-llama-4gib.json 2>/dev/null
step pack
tar cJf $OUT/callbx.tar.xz -C $W .
