#!/bin/bash
# Session 17, call BB (about 3 min): Llama-3-8B at 4 GiB decode runs (engine.bench.decode_runs) with the profile
# whose CPU attention factor call AA measured (carry/h200-profile-new.json), then with the old one; call AA's run
# with the new profile ended within 46 s printing nothing, so this one keeps stderr and a fault handler.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbb; mkdir -p $W
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "Llama 4 GiB decode runs, new profile"
SLIPSTREAM_PROFILE_DB=carry/h200-profile-new.json timeout 110 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --out $W/runs-new > $W/new.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/new.log | tail -14
step "Llama 4 GiB decode runs, old profile"
SLIPSTREAM_PROFILE_DB=carry/h200-profile.json timeout 100 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --out $W/runs-old > $W/old.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/old.log | tail -9
dmesg 2>/dev/null | tail -5
step pack
tar cJf $OUT/callbb.tar.xz -C $W .
