#!/bin/bash
# Session 20, call Q (about 5 min): why call P's CPU shares ran slower than priced.
# 1. Llama-3-8B 4 GiB, one engine, rounds taking turns (share_ab): the planner's shares, none, and 1792 rows
#    forced; prefill 512 / 4096 and decode with the executor's sub-layer timer on (host ms per
#    placement/kind), and before the rounds the host's share of one FFN timed alone (1792 and 3584 rows).
# 2. Call O's MoE 2 GiB split A/B without the NVML poller, with the allocator retry that call P's
#    out-of-memory asked for (a re-plan at the same budget whose new slot found only cached blocks).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callq; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "Llama 4GiB: shares on / off / 1792 rows, host times"
timeout 170 python3 -m engine.bench.share_ab --shape llama3-8b --budget 4GiB --variants off,on,1792 --rounds 3 \
  --parts prefill,decode --host-times --cpu-part-rows 1792,3584 --out $W/llama-4GiB > $W/llama-4GiB.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/llama-4GiB.log | grep -E "^\||host share|Error|error" | cut -c1-220 | tail -9
step "MoE 2GiB split off/on, no poller"
timeout 140 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 6 --split-variants off,on \
  --out $W/moe-2GiB > $W/moe-2GiB.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/moe-2GiB.log | grep -E "^\| [0-9]|Error|error" | cut -c1-170 | tail -7
step pack
tar cJf $OUT/callq.tar.xz -C $W .
