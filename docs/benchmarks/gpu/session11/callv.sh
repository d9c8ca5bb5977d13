#!/bin/bash
# The next call (written in session 11, not run): where a MoE batch-4 step's remaining 70 ms outside the
# CPU experts goes (diag_batch.py, 4 GiB), then the suite rows of both shapes again on this lease (call T's
# lease read 76 GB/s on the CPU: its single-sequence rows sat 4-25% below call R/Q's on the same code).
# Copy this and diag_batch.py into carry/ first. Starts with the CUDA tests of batched decode.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callv; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-540} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_cuda_graphs.py tests/engine/test_batching.py 2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt; tail -4 $W/tests.txt
step "diag moe"
timeout 120 python3 carry/diag_batch.py qwen3-30b-a3b 4GiB 24 4 2>&1 | tee $W/diag-moe.txt | head -40
step suite
python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -10
cp $W/suite/part-slipstream.json $W/suite/slipstream-logs.tar.xz $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callv.tar.xz -C $W .
