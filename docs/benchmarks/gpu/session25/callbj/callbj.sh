#!/bin/bash
# Session 24's next call, BJ (written, not run; up to 9.5 min). Copy into carry/ with the profile (h200-profile.json).
# 1) The CUDA tests of the KV cache, the executor and transfer coding (admissions now allocated while the copies
#    before them run, waited for together, and coded through the staging ring where it is there: not yet on CUDA).
# 2) prefill_timeline at 4 and 8 GiB with the activation's parts and the KV spills listed: the 8 GiB first long
#    prompt's activation with the admissions pipelined (call BJ0: 212 ms, six admissions one after another 193 ms).
# 3) The KV spill's host copies in one native call over the pool (kv_spill_rate: PyTorch's copies against
#    kernels.copy_many on this host's 16 cores; BJ0 saw 71 ms of a 313 ms 4096-token step spent spilling at 4 GiB).
# 4) The suite's MoE 2 GiB row with the issuer fixed (the table keeps call BC's; BH's read 18.6 t/s before the fix).
# 5) The suite's Llama rows again, as far as the deadline lets them run (the spill's copies on the pool, the
#    admissions pipelined): then part_replace for both parts and the merge.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbj; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_host_kv.py tests/engine/test_executor.py tests/engine/test_transfer_code.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -8
step "prefill timeline, 4 and 8 GiB"
timeout 150 python3 -m engine.bench.prefill_timeline --shape llama3-8b --budgets 4GiB,8GiB --runs 2 \
  --out $W/timeline > $W/timeline.log 2>&1; echo "rc=$?"
grep -v USDT $W/timeline.log | cut -c1-160 | head -70
step "KV spill copies, PyTorch against the native pool"
timeout 60 python3 -m engine.bench.kv_spill_rate --shape llama3-8b --tokens 4096 --out $W/spill > $W/spill.log 2>&1; echo "rc=$?"
tail -5 $W/spill.log
step "MoE 2 GiB row"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB --out $W/moe \
  --deadline-epoch $((D-160)) > $W/moe.log 2>&1; echo "rc=$?"; grep -h "slipstream qwen3\|opened" $W/moe.log | tail -3
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe-2gib.json 2>/dev/null
step "llama3-8b rows"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-8)) \
  > $W/llama.log 2>&1; echo "rc=$?"; grep -h "slipstream llama3-8b\|opened" $W/llama.log | tail -4
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step pack
tar cJf $OUT/callbj.tar.xz -C $W .
