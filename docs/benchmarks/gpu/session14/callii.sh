#!/bin/bash
# Session 14, call II (about 9.5 min): the CPU MoE layer call (moe.layer_decode_cpu, one native call per
# decode layer whose router and experts are on the CPU) on the GPU machine: the decode A/B alternating in one engine at 4,
# 2 and 8 GiB (engine.bench.moe_layer_ab), the CUDA tests of the MoE paths (the routing's top k is now a
# stable sort: graphs included), then the suite's MoE rows (Slipstream) with it.
# Copy this and docs/benchmarks/profiles/h200.json (as h200-profile.json) into carry/ first.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callii; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "layer call A/B"
timeout 170 python3 -m engine.bench.moe_layer_ab --layers 24 --budgets 4GiB,2GiB,8GiB --reps 3 --out $OUT 2>&1 | grep -v "^USDT" | tail -12
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_moe_host_path.py tests/engine/test_moe.py tests/engine/test_cuda_graphs.py tests/engine/test_moe_stream.py > $W/tests.txt 2>&1; tail -3 $W/tests.txt
step suite
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $((D-8)) 2>&1 | grep -v "^USDT" | tail -14
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callii.tar.xz -C $W .
