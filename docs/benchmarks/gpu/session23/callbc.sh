#!/bin/bash
# Session 23, call BC (up to 9.5 min): the suite's Slipstream rows with transfer coding on (the default since
# call BB): Llama-3-8B at 2, 4 and 8 GiB, then the MoE shape as far as the deadline lets it (each row is kept as
# it finishes); before them the coded copy's rate (transfer_code_rate, its decode-alone row fixed after BB).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbc; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-565} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "rate"
timeout 60 python3 -m engine.bench.transfer_code_rate --mib 448 --reps 10 --out $W/rate > $W/rate.log 2>&1; echo "rc=$?"
grep -v USDT $W/rate.log | tail -7
step "llama3-8b rows"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-200)) \
  > $W/llama.log 2>&1; echo "rc=$?"; grep -h "slipstream llama3-8b\|opened\|part slipstream" $W/llama.log | tail -5
step "qwen3-30b-a3b rows"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/moe --deadline-epoch $((D-8)) \
  > $W/moe.log 2>&1; echo "rc=$?"; grep -h "slipstream qwen3\|opened\|part slipstream" $W/moe.log | tail -5
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step pack
tar cJf $OUT/callbc.tar.xz -C $W .
