#!/bin/bash
# Session 16, call UU (about 3 min): the suite's decode runs one after another, each token timed, with what
# the engine did in each (engine.bench.decode_runs), at 4 GiB on both shapes: call TT's suite runs were
# 31.1, 20.3, 22.0, 29.7, 22.1 t/s (MoE) and 7.4, 8.6, 7.3, 9.0, 9.0 t/s (Llama-3-8B). Copy this and the
# profile (h200-profile.json) into carry/.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=/tmp/calluu; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "MoE 4 GiB decode runs"
timeout 150 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 4GiB --runs 10 --out $W/moe 2>&1 | grep -v "^USDT" | tail -13
step "Llama 4 GiB decode runs"
timeout 150 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 8 --out $W/llama 2>&1 | grep -v "^USDT" | tail -11
step pack
tar cJf $OUT/calluu.tar.xz -C $W .
