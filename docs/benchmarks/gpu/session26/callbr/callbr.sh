#!/bin/bash
# Session 26, call BR (about 6 min). 0) The CUDA tests of what changed after session 25's last call (coded copies
# crossing into the staging ring ahead, a prompt's re-plan bringing in its step's plan, the host KV tier's
# 256 MiB chunks and spill thread) and of the host KV tier, the OOM retry and the executor.
# 1) Decode with the ring running ahead off and on, in turns inside one engine (abba): Llama-3-8B shape at
# 4 GiB (16 FFNs streamed a token between CPU sub-layers) and the MoE shape at 2 GiB.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbr; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_host_kv.py \
  tests/engine/test_transfer_code.py tests/engine/test_oom_retry.py tests/engine/test_replan_first_plan.py \
  tests/engine/test_executor.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -8
step "Llama-3-8B 4 GiB, ring ahead off/on"
timeout 150 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --tokens 48 \
  --ring-ahead-variants off,on --order abba --out $W/llama > $W/llama.log 2>&1; echo "rc=$?"
grep "^|" $W/llama.log | cut -c1-150 | head -9
step "Qwen3-30B-A3B 2 GiB, ring ahead off/on"
timeout 170 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 4 --tokens 48 \
  --ring-ahead-variants off,on --order abba --out $W/moe > $W/moe.log 2>&1; echo "rc=$?"
grep "^|" $W/moe.log | cut -c1-150 | head -7
step pack
tar cJf $OUT/callbr.tar.xz -C $W .
