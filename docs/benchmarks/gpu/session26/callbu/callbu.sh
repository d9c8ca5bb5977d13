#!/bin/bash
# Session 26, call BU (about 4 min): which switch takes the transfer-code test's failure away (call BO: the raw
# side's first run moving at its last token, in both processes that ran test_host_kv.py first; call BS: each graph
# replay gave its eager run's bits, and the files passed with SLIPSTREAM_CUDA_GRAPHS=0; call BT's variants, one
# test selected by node id, each ran past its 45 s and left nothing). The two files as call BO ran them, in a
# fresh process per variant, each result kept as it comes; pytest dumps every thread's stack past 40 s.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbu; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
for v in default SLIPSTREAM_CUDA_GRAPHS=0 SLIPSTREAM_GRAPH_CLEAR_WORKSPACES=0 SLIPSTREAM_GRAPH_ATTENTION=0 \
         SLIPSTREAM_GRAPH_HOST_IO=0 SLIPSTREAM_KV_SPILL_THREAD=0 SLIPSTREAM_COPY_ISSUER=0; do
  [ $(( $(date +%s) - T0 )) -gt 270 ] && { echo "(out of time before $v)"; break; }
  echo "=== $v ($(( $(date +%s) - T0 )) s)"
  name=${v%%=*}
  env $( [ $v != default ] && echo $v ) SLIPSTREAM_TEST_DEVICE=cuda timeout 55 python3 -m pytest -q -p no:cacheprovider \
    --tb=short -o faulthandler_timeout=40 tests/engine/test_host_kv.py tests/engine/test_transfer_code.py > $W/$name.txt 2>&1
  echo "rc=$?"; grep "Failed\|passed\|failed\|Timeout" $W/$name.txt | cut -c1-700 | tail -3
  cp $W/$name.txt $OUT/
done
