#!/bin/bash
# Session 18, call E (about 8 min): the suite's MoE rows planned from the calibrated profile (the CPU
# attention priced as the executor runs it), after call D's MoE 2 GiB row died: an out-of-memory in the re-plan that follows an out-of-memory (the KV cut took new VRAM), now moved to host memory and retried smaller.
# with each row's rates probed before and after its engine. Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/calle; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-570} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "suite, MoE, with the OOM retry fix"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/llama --deadline-epoch $((D-10)) > $W/suite.log 2>&1
echo "rc=$?"; grep -v "^USDT" $W/suite.log | tail -14
cp $W/llama/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step pack
tar cJf $OUT/calle.tar.xz -C $W .
