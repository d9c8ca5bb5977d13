#!/bin/bash
# Session 23, call BA (about 8 min): transfer coding of streamed bf16 weights (engine/sharding/transfer_code.py).
# 1) Triton there? The coded copy's rate against a plain copy (`transfer_code_rate`). 2) The CUDA tests of the
# coding, and the executor's. 3) The suite's Llama-3-8B 4 GiB row with coding off and on, processes taking turns
# (off, on, on, off), each its own engine (SLIPSTREAM_TRANSFER_CODE=0/1).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callba; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "triton"
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
step "rate"
timeout 90 python3 -m engine.bench.transfer_code_rate --mib 448 --reps 10 --out $W/rate > $W/rate.log 2>&1; echo "rc=$?"
grep -v USDT $W/rate.log | tail -8
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_transfer_code.py tests/engine/test_executor.py 2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt
tail -6 $W/tests.txt
for v in 0 1 1 0; do
  step "llama3-8b 4GiB, transfer coding $v"
  SLIPSTREAM_TRANSFER_CODE=$v timeout 150 python3 -m engine bench --gpu --part slipstream --models llama3-8b \
    --budgets 4GiB --out $W/s$v-$(date +%s) > $W/s$v-$(date +%s).log 2>&1; echo "rc=$?"
  grep -h "slipstream llama3-8b\|opened" $(ls -t $W/s$v-*.log | head -1) | tail -3
done
step pack
tar cJf $OUT/callba.tar.xz -C $W .
