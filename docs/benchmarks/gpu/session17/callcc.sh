#!/bin/bash
# Session 17, call CC (about 2.5 min): Llama-3-8B at 4 GiB decode runs with call AA's profile (the CPU attention
# priced as the executor runs it), which segfaulted in calls AA and BB in the native FFN call (a general
# protection fault in the library), now with the pool's job counter closed before a new job's fields change
# (cpu_linear.c run_pool); then the same with the AMX tiles off (SLIPSTREAM_CPU_AMX=0), which tells the two
# candidate causes apart if it still crashes.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1 SLIPSTREAM_PROFILE_DB=carry/h200-profile-new.json
W=/tmp/callcc; mkdir -p $W
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "Llama 4 GiB decode runs, new profile, pool fix"
timeout 90 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --out $W/runs-fix > $W/fix.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/fix.log | tail -9
step "the same, AMX tiles off"
SLIPSTREAM_CPU_AMX=0 timeout 80 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 5 --out $W/runs-noamx > $W/noamx.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/noamx.log | tail -8
dmesg 2>/dev/null | grep -i "fault" | tail -3
step pack
tar cJf $OUT/callcc.tar.xz -C $W .
