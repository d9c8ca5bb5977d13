#!/bin/bash
# Session 18, call D (about 8 min): the suite's rows of both shapes planned from the calibrated profile (the CPU
# attention priced as the executor runs it: call 17-AA's measurement, adopted after call A's A/B in one engine), on call C's lease (which decoded both shapes faster than call B's),
# with each row's rates probed before and after its engine. Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/calld; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-570} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "suite, both shapes, calibrated profile"
python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/llama --deadline-epoch $((D-10)) > $W/suite.log 2>&1
echo "rc=$?"; grep -v "^USDT" $W/suite.log | tail -14
cp $W/llama/part-slipstream.json $OUT/part-slipstream-both.json 2>/dev/null
step pack
tar cJf $OUT/calld.tar.xz -C $W .
