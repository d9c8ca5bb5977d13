#!/bin/bash
# Session 24, call BG (about 5 min).
# 1) The CUDA tests of transfer coding again (BF: the planned-budget test now replays the coded run's plan
#    sets for raw copies, with no plan re-priced on a thread; the CPU coded matmul test asks for up to m rows).
# 2) Where the 4096-token prompt's time goes at 4 and 8 GiB (BF: one tier-4096 step 156 ms at 8 GiB, the
#    suite's prefill 287 ms): prefill_timeline.
# 3) The issuer thread off/on again, 12 runs in turns (BF, 8 runs: median token 110 ms off, 103 on; t/s within the drift).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbg; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_transfer_code.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -8
step "prefill timeline, 4 and 8 GiB"
timeout 180 python3 -m engine.bench.prefill_timeline --shape llama3-8b --budgets 4GiB,8GiB --runs 2 \
  --out $W/timeline > $W/timeline.log 2>&1; echo "rc=$?"
grep -v USDT $W/timeline.log | head -60 | cut -c1-150
step "decode, issuer off/on"
timeout 220 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 12 --issuer-variants off,on \
  --order abba --out $W/issuer > $W/issuer.log 2>&1; echo "rc=$?"
grep "^| [0-9]" $W/issuer.log | cut -d'|' -f2,8,10,12,13
step pack
tar cJf $OUT/callbg.tar.xz -C $W .
