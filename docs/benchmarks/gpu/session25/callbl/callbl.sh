#!/bin/bash
# Session 25, call BL (about 6.5 min). 1) The CUDA tests of call BJ's set again (one coded test parted from the raw
# copies at its last token there, not in call BK) and the out-of-memory paths. 2) prefill_timeline at 4 and 8
# GiB: the host tier now pins its chunks outside the lock its slots are taken under (BJ: a 4096-token prompt
# after another spent 42 ms at 4 GiB and 52 ms at 8 GiB in the spill in front of its step); the timeline now
# lists the spill's copies and the tier's chunks. 3) The co-run with transfer coding and the copy issuer
# (session 22's call AH ran before both).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbl; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-400} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_host_kv.py \
  tests/engine/test_executor.py tests/engine/test_transfer_code.py tests/engine/test_oom_retry.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -6
step "prefill timeline, 4 and 8 GiB"
timeout 120 python3 -m engine.bench.prefill_timeline --shape llama3-8b --budgets 4GiB,8GiB --runs 2 \
  --out $W/timeline > $W/timeline.log 2>&1; echo "rc=$?"
grep -v USDT $W/timeline.log | grep -v "^ .*_add_chunk" | cut -c1-150 | head -60
step "co-run"
python3 -m engine bench --gpu --part corun --corun-systems slipstream,slipstream+overhead --out $W/corun \
  --prior carry/bench --deadline-epoch $((D-5)) > $W/corun.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/corun.log | tail -8
cp $W/corun/part-corun.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callbl.tar.xz -C $W .
