#!/bin/bash
# Session 24, call BJ0 (about 2 min, the device time's last minutes): the CUDA tests of the KV cache (a pool
# resize in one copy a part), then prefill_timeline at 4 and 8 GiB with the activation's parts and the spills listed.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbj0; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
SLIPSTREAM_TEST_DEVICE=cuda timeout 40 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_host_kv.py > $W/tests.txt 2>&1
tail -2 $W/tests.txt
timeout 110 python3 -m engine.bench.prefill_timeline --shape llama3-8b --budgets 4GiB,8GiB --runs 2 \
  --out $W/timeline > $W/timeline.log 2>&1; echo "rc=$?"
grep -v USDT $W/timeline.log | cut -c1-300 | head -60
tar cJf $OUT/callbj0.tar.xz -C $W .
