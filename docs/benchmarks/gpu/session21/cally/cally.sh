#!/bin/bash
# Session 21, call Y (about 8 min): expandable segments on by default (`device.expandable_segments`). (1) Call
# X's re-plan at 2 GiB (the MoE shape's head made resident), which ran out of memory with fixed segments, now
# without PYTORCH_CUDA_ALLOC_CONF set. (2) The CUDA engine tests with the new default.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/cally; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "MoE 2 GiB: the planner's plan and the head made resident, in turns"
timeout 150 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 4 --order abba \
  --cpu-variants "none,head=resident+layers.*.attn=cpu" --out $W/moe2 > $W/moe2.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/moe2.log | grep -E "^\| [0-9]|Error|error" | cut -c1-200 | tail -6
step "CUDA engine tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 330 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_vram_cap.py tests/engine/test_expandable_segments.py tests/engine/test_cuda_graphs.py \
  tests/engine/test_executor.py tests/engine/test_moe.py tests/engine/test_moe_host_path.py tests/engine/test_fidelity.py \
  tests/engine/test_ffn_share.py tests/engine/test_move_to_cpu.py tests/engine/test_vision_engine.py \
  2>&1 | grep -v "^  *File\|^$" | tail -40 > $W/tests.txt; tail -12 $W/tests.txt
step pack
tar cJf $OUT/cally.tar.xz -C $W .
