#!/bin/bash
# Session 19, call O (written, not run; about 7 min): the decode tiers planned apart from the prompts'
# (Planner split_small, TorchEngine.split_plans; off by default). All tiers of a plan set share how many
# layers keep their KV cache in VRAM and whether the head is resident; at 2 GiB the MoE shape's prompts want
# every layer's KV there, which leaves the head (622 MB) on the CPU in every tier: 6 ms of each decode step
# (call M's trace). Apart (tiers of up to 4 tokens), the decode tiers keep 9 layers' KV and stream the head behind the layers' work:
# 38.6 ms predicted against 43.1 (the KV and head moves at each switch priced). In one engine, runs taking
# turns (decode_runs --split-variants off,on): the MoE decode at 2 GiB and Llama-3-8B at 8 GiB (72.6 against
# 74.0 predicted), then the CUDA tests of plan switches and budgets with it on.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callo; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
for sb in qwen3-30b-a3b:2GiB llama3-8b:8GiB; do
  s=${sb%%:*}; b=${sb##*:}
  step "$s $b decode: tiers planned together / apart, in turns"
  timeout 200 python3 -m engine.bench.decode_runs --shape $s --budget $b --runs 8 --split-variants off,on \
    --poll-s 0.02 --out $W/$s-$b > $W/$s-$b.log 2>&1; echo "rc=$?"
  grep -v "^USDT" $W/$s-$b.log | grep -E "^\| [0-9]|Error|error" | cut -c1-170 | tail -9
done
step "CUDA tests with the split on"
SLIPSTREAM_PLAN_SPLIT=1 SLIPSTREAM_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_vram_cap.py tests/engine/test_oom_retry.py tests/engine/test_executor.py tests/engine/test_plan_split.py \
  2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt; tail -6 $W/tests.txt
step pack
tar cJf $OUT/callo.tar.xz -C $W .
