#!/bin/bash
# Session 20, call R (about 5 min): the MoE decode's captured attention run from the host (new
# OneTokenGraphs.run_host): between CPU expert layers the hidden state crosses straight into the graph's
# input and out of its output through pinned twins, with no device tensor, device copy or clone around the
# replay (call M's trace: about 0.5 ms of host time per GPU attention against 0.09 ms of kernels). In one
# engine, runs taking turns (decode_runs --host-io-variants off,on), no NVML poller: Qwen3-30B-A3B shape at 2
# and 4 GiB. Then the CUDA graph tests, the new one included (the same tokens either way).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callr; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
for b in 2GiB 4GiB; do
  step "MoE $b decode: host io off / on, in turns"
  timeout 130 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget $b --runs 8 --host-io-variants off,on \
    --out $W/moe-$b > $W/moe-$b.log 2>&1; echo "rc=$?"
  grep -v "^USDT" $W/moe-$b.log | grep -E "^\| [0-9]|Error|error" | cut -c1-170 | tail -9
done
step "CUDA graph tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_cuda_graphs.py \
  2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt; tail -4 $W/tests.txt
step pack
tar cJf $OUT/callr.tar.xz -C $W .
