#!/bin/bash
# Session 18, call C (about 5 min): the decode at CPU thread counts 16, 15, 14 and 12 taking turns in one engine
# (decode_runs --threads), under one plan each, for the Llama-3-8B and the Qwen3-30B-A3B shapes at 4 GiB: whether
# a core left to the main thread's Python, the CUDA driver and the copies' host work (the pool otherwise holds all
# 16 vCPUs, and a preempted worker holds its chunk, and so its job, until it runs again) beats the 16th thread's
# bandwidth. Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callc; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
for shape in llama3-8b qwen3-30b-a3b; do
  step "$shape 4 GiB decode runs, threads 16/15/14/12 in turns"
  timeout 270 python3 -m engine.bench.decode_runs --shape $shape --budget 4GiB --runs 12 --threads 16,15,14,12 \
    --out $W/$shape > $W/$shape.log 2>&1; echo "rc=$?"
  grep -v "^USDT" $W/$shape.log | grep -E "^\| [0-9]|rc=|Error|error" | cut -c1-120 | tail -14
done
step pack
tar cJf $OUT/callc.tar.xz -C $W .
