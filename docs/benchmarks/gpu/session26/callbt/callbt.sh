#!/bin/bash
# Session 26, call BT (about 2.5 min): which switch takes the transfer-code test's failure away (call BO: the
# raw side's first run moving at its last token, in every process that ran test_host_kv.py first; call BS:
# every graph replay gives its eager run's bits, and the files pass with SLIPSTREAM_CUDA_GRAPHS=0).
# The host KV tests, then the failing test, in a fresh process per variant.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbt; mkdir -p $W
T=tests/engine/test_transfer_code.py::test_placements_changing_mid_generation_keep_the_tokens_coded
for v in default SLIPSTREAM_CUDA_GRAPHS=0 SLIPSTREAM_GRAPH_HOST_IO=0 SLIPSTREAM_GRAPH_ATTENTION=0 \
         SLIPSTREAM_KV_SPILL_THREAD=0 SLIPSTREAM_COPY_ISSUER=0 SLIPSTREAM_RING_AHEAD=0 alone; do
  pre=tests/engine/test_host_kv.py; [ $v = alone ] && pre=
  echo "=== $v ($(date +%T))"
  env $( [ $v != default ] && [ $v != alone ] && echo $v ) SLIPSTREAM_TEST_DEVICE=cuda timeout 45 python3 -m pytest -q \
    -p no:cacheprovider --tb=short $pre "$T" > $W/$v.txt 2>&1
  grep "Failed\|passed\|failed" $W/$v.txt | cut -c1-900 | tail -2
done
tar cJf $OUT/callbt.tar.xz -C $W .
