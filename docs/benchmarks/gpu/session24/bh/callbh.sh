#!/bin/bash
# Session 24, call BH (up to 9 min): the CUDA tests after BG (the random-placement test with no plan
# re-priced on a thread; host KV pools that keep their room across a capacity cut), the 4096-token prompt's
# timeline again (BG: the first one after shorter prompts re-made the host KV pools: 172 / 385 ms), then the
# suite's Slipstream rows of both shapes with coded copies issued from their own thread (new since BC).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbh; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-545} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_transfer_code.py tests/engine/test_host_kv.py tests/engine/test_executor.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -8
step "prefill timeline, 4 and 8 GiB"
timeout 150 python3 -m engine.bench.prefill_timeline --shape llama3-8b --budgets 4GiB,8GiB --runs 2 \
  --out $W/timeline > $W/timeline.log 2>&1; echo "rc=$?"
grep "tokens run\|activate" $W/timeline.log | cut -c1-120
step "llama3-8b rows"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-175)) \
  > $W/llama.log 2>&1; echo "rc=$?"; grep -h "slipstream llama3-8b\|opened\|part slipstream" $W/llama.log | tail -5
step "qwen3-30b-a3b rows"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/moe --deadline-epoch $((D-8)) \
  > $W/moe.log 2>&1; echo "rc=$?"; grep -h "slipstream qwen3\|opened\|part slipstream" $W/moe.log | tail -5
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step pack
tar cJf $OUT/callbh.tar.xz -C $W .
