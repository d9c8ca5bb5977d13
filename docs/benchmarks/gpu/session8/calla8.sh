#!/bin/bash
# Session 8, call A: host time per kind of sub-layer (SmolLM2-135M all-GPU and static; the MoE shape, 8 of 48
# layers, auto and static at 4 GiB), then the suite's Slipstream rows, one shape per process.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/calla; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "host_costs smollm2"
timeout 90 python3 -m engine.bench.host_costs --device cuda --shape smollm2-135m --budget 60GiB --kinds gpu_only,static --tokens 48 --out $W/hc-smollm2 2>&1 | tail -40
step "host_costs moe"
timeout 150 python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 4GiB --kinds auto,static --tokens 48 --out $W/hc-moe 2>&1 | tail -40
step "suite"
python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | tail -14
step pack
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
tar cJf $OUT/calla8.tar.xz -C $W .
