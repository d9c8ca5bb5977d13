#!/bin/bash
# Session 26, call BS (about 2 min): call BO met the transfer-code test's raw run moving at its last token in two
# processes out of two, the run with fewer CUDA graph replays (20 against 24) giving the other token.
# 1) graph_bits.py: each one-token graph replay against its eager run, bit for bit, on the test's schedule.
# 2) The test's files with SLIPSTREAM_CUDA_GRAPHS=0 (all eager).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbs; mkdir -p $W
echo "=== graph bits ($(date +%T))"
timeout 100 python3 carry/graph_bits.py > $W/bits.txt 2>&1; echo "rc=$?"; grep -v "Writing\|USDT" $W/bits.txt | tail -30
echo "=== tests without graphs ($(date +%T))"
SLIPSTREAM_CUDA_GRAPHS=0 SLIPSTREAM_TEST_DEVICE=cuda timeout 70 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_host_kv.py tests/engine/test_transfer_code.py > $W/tests-nographs.txt 2>&1
grep "Failed\|passed\|failed\|FAILED" $W/tests-nographs.txt | cut -c1-1200 | tail -4
tar cJf $OUT/callbs.tar.xz -C $W .
