#!/bin/bash
# Session 16, call VV (about 2 min): call UU's MoE 4 GiB decode runs again after the change that keeps a
# one-step prompt on the decode plan where the switch costs more than it saves (TorchEngine._staying_pays):
# in call UU the second token of every run took 67-115 ms against 25-33. Copy this and the profile into carry/.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=/tmp/callvv; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
timeout 150 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 4GiB --runs 10 --out $W/moe 2>&1 | grep -v "^USDT" | tail -13
tar cJf $OUT/callvv.tar.xz -C $W .
