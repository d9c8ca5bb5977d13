#!/bin/bash
# The next call (written in session 12, not run): the fixes made after session 12's last call, on the GPU.
# - CUDA tests of the host-KV read over out-of-order blocks (pinned gather) and the allocator cap's room
#   for lazily loaded kernels;
# - the Llama 2 GiB 4096-token prompt the suite's way (carry/diag_prefill.py: four 1024-token steps; call
#   ZZ spent 0.68 s of 1.39 s in pageable KV copies);
# - the suite rows of both shapes (the MoE 2 GiB peak had been 16 MiB over its budget).
# Copy this, diag_prefill.py and docs/benchmarks/profiles/h200.json (as h200-profile.json) into carry/ first.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callaa; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-520} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_executor.py tests/engine/test_vram_cap.py tests/engine/test_host_kv.py tests/engine/test_moe_host_path.py 2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt; tail -4 $W/tests.txt
step "diag llama"
timeout 80 python3 carry/diag_prefill.py llama3-8b 2GiB 0 4096 2>&1 | tee $W/diag-llama.txt | head -8
step suite
python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -10
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callaa.tar.xz -C $W .
