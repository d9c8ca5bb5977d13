#!/bin/bash
# Session 30, call CL (about 4 min): the engine's tests that run on a GPU, with SLIPSTREAM_TEST_DEVICE=cuda, at
# the code that closes issue 6 (session 29's two out-of-memory fixes: escapes in slices, and a re-plan that runs
# short backs off at a KV cut, an idle budget change and forced plans). Call BZ's 14 files, with the
# expandable-segments and estimator tests.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
cp carry/h200-profile.json /tmp/profile.json; export SLIPSTREAM_PROFILE_DB=/tmp/profile.json
echo "=== CUDA tests ($(date +%T))"
SLIPSTREAM_TEST_DEVICE=cuda timeout 420 python3 -m pytest -q -p no:cacheprovider --tb=short -o faulthandler_timeout=100 \
  tests/engine/test_transfer_code.py tests/engine/test_host_kv.py tests/engine/test_executor.py tests/engine/test_cuda_graphs.py \
  tests/engine/test_oom_retry.py tests/engine/test_replan_first_plan.py tests/engine/test_ffn_share.py \
  tests/engine/test_vram_cap.py tests/engine/test_fidelity.py tests/engine/test_moe.py tests/engine/test_moe_host_path.py \
  tests/engine/test_gguf_16bit.py tests/engine/test_vision_engine.py tests/engine/test_planner.py \
  tests/engine/test_expandable_segments.py tests/engine/test_estimator.py > $OUT/tests-cuda.txt 2>&1
echo "rc=$? ($(date +%T))"; grep "Failed\|passed\|failed\|FAILED\|Timeout" $OUT/tests-cuda.txt | cut -c1-600 | tail -12
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
