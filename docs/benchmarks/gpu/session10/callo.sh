#!/bin/bash
# Call O (session 10): why the captured one-token attention's CUDA test failed in call M (its traceback, and
# the SDPA kernels' results on CUDA compared), then what call N was written for: accelerate on the MoE shape
# (never run), the CPU experts' read rate with the software prefetch, and the H200 profile measured again.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-490} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_PROFILE_DB=/tmp/profile.json SLIPSTREAM_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_cuda_graphs.py -k "captured_decode_attention" 2>&1 | grep -v "^  *File\|^$" | tail -30 > $OUT/tests.txt; tail -30 $OUT/tests.txt
step kernels
timeout 60 python3 carry/attn_kernels.py 2>&1 | tail -12 | tee $OUT/kernels.txt
step profile
SLIPSTREAM_PROFILE_DB=$OUT/h200-profile.json timeout 120 python3 -m engine profile --device cuda 2>&1 | tail -6 | tee $OUT/calln.log
step experts
timeout 40 python3 -m engine.bench.moe_cpu_experts --out $OUT 2>&1 | tail -3 | tee -a $OUT/calln.log
step accelerate
python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --out $OUT --prior carry/bench --deadline-epoch $D 2>&1 | tail -8 | tee -a $OUT/calln.log
step end
