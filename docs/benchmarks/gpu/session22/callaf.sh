#!/bin/bash
# Session 22, call AF (about 7 min). 1) Where the MoE decode's GPU attention spends its 0.41-0.47 ms of host
# time (call AE, `share_ab --host-times`; about 0.09 ms of it kernels, session 19's trace) at 2 GiB, under
# the planner's own plan: `moe_host_overhead --plan planner` (new) with perf_counter probes around the
# host path's pieces (index inputs, rope buffers, graph key, run_host's copies, the replay's launch, the wait
# for the GPU). 2) The CUDA engine tests with expandable segments on by default (new this session).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callaf; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "MoE 2 GiB host probes"
timeout 170 python3 -m engine.bench.moe_host_overhead --layers 24 --device cuda --plan planner --budget 2GiB \
  --steps 32 --reps 100 --no-profile --out $W/probe > $W/probe.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/probe.log | tail -32
step "CUDA engine tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_vram_cap.py tests/engine/test_expandable_segments.py tests/engine/test_cuda_graphs.py \
  tests/engine/test_executor.py tests/engine/test_moe.py tests/engine/test_moe_host_path.py tests/engine/test_fidelity.py \
  tests/engine/test_ffn_share.py tests/engine/test_move_to_cpu.py tests/engine/test_vision_engine.py \
  2>&1 | grep -v "^  *File\|^$" | tail -40 > $W/tests.txt; tail -12 $W/tests.txt
step pack
tar cJf $OUT/callaf.tar.xz -C $W .
