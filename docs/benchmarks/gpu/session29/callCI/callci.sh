#!/bin/bash
# Session 29, call CI (up to 7.5 min). Copy into carry/ with the profile (h200-profile.json).
# Calls CG and CH ran the Llama 2/8 GiB and MoE 2/4/8 GiB rows at the defaults on leases whose first probe
# showed 13-15% CPU steal (one-token matmuls 50-54 GB/s against some 89-130 on a quiet lease): their decodes
# came out below the older rows (Llama 2 GiB 8.01 against 8.96, MoE 2 GiB 21.9 against 31.9), which one-engine
# turns had shown 15% slower without the prefetching. The same rows again, for a lease that is quiet.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callci; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-450} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "llama3-8b rows, 2 and 8 GiB"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 2GiB,8GiB --out $W/llama \
  --deadline-epoch $((D-245)) > $W/llama.log 2>&1; echo "rc=$?"; grep -h "lease probe\|slipstream llama3-8b" $W/llama.log | cut -c1-200 | tail -4
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step "MoE rows, 2, 4 and 8 GiB"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB,4GiB,8GiB --out $W/moe \
  --deadline-epoch $((D-5)) > $W/moe.log 2>&1; echo "rc=$?"
grep -h "lease probe\|slipstream qwen3\|Error" $W/moe.log | cut -c1-300 | tail -5
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step pack
tar cJf $OUT/callci.tar.xz -C $W .
