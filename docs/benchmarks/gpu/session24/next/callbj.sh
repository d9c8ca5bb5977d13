#!/bin/bash
# Session 24's next call, BJ (written, not run; about 6.5 min). Copy into carry/ with the profile (h200-profile.json).
# 1) The CUDA tests of the KV cache and the executor (a KV pool resize now copies its kept blocks in one copy a
#    part, not one a block; host pools keep their room across a capacity cut).
# 2) prefill_timeline at 4 and 8 GiB with the activation's parts listed (evictions, admissions, KV resizes, slots):
#    what is left of the first long prompt's activation (call BH: 74 / 341 ms), and why the second 4096-token
#    prompt's step is slower than the first (BG, BH: 240 vs 221 ms at 8 GiB; planner_accuracy's step: 156 ms).
# 3) The suite's MoE 2 GiB row with the issuer fixed (the table keeps call BC's; BH's read 18.6 t/s before the fix).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbj; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-450} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_host_kv.py tests/engine/test_executor.py tests/engine/test_transfer_code.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -8
step "prefill timeline, 4 and 8 GiB"
timeout 150 python3 -m engine.bench.prefill_timeline --shape llama3-8b --budgets 4GiB,8GiB --runs 2 \
  --out $W/timeline > $W/timeline.log 2>&1; echo "rc=$?"
grep -v USDT $W/timeline.log | cut -c1-160 | head -70
step "MoE 2 GiB row"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB --out $W/moe \
  --deadline-epoch $((D-8)) > $W/moe.log 2>&1; echo "rc=$?"; grep -h "slipstream qwen3\|opened" $W/moe.log | tail -3
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe-2gib.json 2>/dev/null
step pack
tar cJf $OUT/callbj.tar.xz -C $W .
