#!/bin/bash
# Session 20, call P (about 8 min): the streamed FFNs' CPU share (Plan.ffn_cpu_rows, new this session).
# 1. Llama-3-8B at 4 GiB, one engine, rounds taking turns (engine.bench.share_ab): the planner's shares
#    (predicted on the H200 profile: tier 16 141.9 against 145.7 ms, tier 64 153.9 against 185.5, tier 256
#    191.7 against 219.6, tier 1024 214.5 against 221.4; tiers 1 and 4 none), no share, and 1792 / 3584 rows
#    forced into every plan (the one-token plan too: does the decode have CPU time to spare that the
#    estimator does not see?). Prefill 512 / 4096, decode, batches of 4 and 16.
# 2. The CUDA tests of the share, of random placements and of the budget caps.
# 3. Call O's MoE 2 GiB split A/B again without the NVML poller (call O's poller ran beside every "on" run).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callp; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "Llama 4GiB: shares on / off / 1792 / 3584 rows, in turns"
timeout 260 python3 -m engine.bench.share_ab --shape llama3-8b --budget 4GiB --variants on,off,1792,3584 \
  --rounds 3 --out $W/llama-4GiB > $W/llama-4GiB.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/llama-4GiB.log | grep -E "^\||Error|error" | cut -c1-220 | tail -8
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_ffn_share.py tests/engine/test_executor.py tests/engine/test_vram_cap.py \
  2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt; tail -6 $W/tests.txt
step "MoE 2GiB split off/on, no poller"
timeout 150 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 6 --split-variants off,on \
  --out $W/moe-2GiB > $W/moe-2GiB.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/moe-2GiB.log | grep -E "^\| [0-9]|Error|error" | cut -c1-170 | tail -7
step pack
tar cJf $OUT/callp.tar.xz -C $W .
