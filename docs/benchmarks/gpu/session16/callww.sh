#!/bin/bash
# Session 16, call WW (about 3 min): is the suite's in-process NVML poller (a thread sampling every 20 ms)
# what slows some of its decode runs by a third? engine.bench.decode_runs with every other run beside such a
# poller, MoE and Llama-3-8B at 4 GiB (call UU's runs, without a poller: Llama within 5%, MoE 27.9-37.3;
# call TT's suite runs, with one: 7.3-9.0 and 20.3-31.1). Copy this and the profile into carry/.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=/tmp/callww; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
timeout 120 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 4GiB --runs 12 --poll-s 0.02 --out $W/moe 2>&1 | grep -v "^USDT" | tail -15
timeout 100 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 8 --poll-s 0.02 --out $W/llama 2>&1 | grep -v "^USDT" | tail -11
tar cJf $OUT/callww.tar.xz -C $W .
