#!/bin/bash
# Session 11, call T: CUDA tests of the batched one-token attention (VRAM and host KV) and the MoE bulk
# path with its native scatter-add; the batch's CPU experts once more; then the suite rows of both shapes.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callt; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-520} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 110 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_cuda_graphs.py tests/engine/test_moe_host_path.py tests/engine/test_executor.py 2>&1 | grep -v "^  *File\|^$" | tail -40 > $W/tests.txt; tail -8 $W/tests.txt
step experts
timeout 40 python3 -m engine.bench.moe_cpu_experts --batches 4,16 --tokens 30 --out $W/experts 2>&1 | grep "batch\|rror"
step suite
python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -10
cp $W/suite/part-slipstream.json $W/suite/slipstream-logs.tar.xz $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callt.tar.xz -C $W .
