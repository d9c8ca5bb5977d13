#!/bin/bash
# Next call (written in session 14, not run; about 9.5 min): the CPU MoE layer call on the GPU machine again,
# after session 14's call II. (1) The suite's MoE rows at 2, 4 and 8 GiB with it: call II's suite run stopped
# at its first budget (the engine's bookable VRAM had shrunk to 590 MiB after open; that call's GPU routing
# used a stable sort, back to topk since). (2) The decode A/B alternating in one engine (routing on the CPU
# is now the same C code both ways: the greedy tokens must match at every budget), with batches of 4 and 16
# streams on and off (the layer call takes steps of up to 16 tokens since call II). (3) The CUDA tests of
# the MoE paths. Copy this and docs/benchmarks/profiles/h200.json (as h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callkk; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step suite
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $((D-330)) 2>&1 | grep -v "^USDT" | tail -14
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step "layer call A/B"
timeout 240 python3 -m engine.bench.moe_layer_ab --layers 24 --budgets 4GiB,2GiB,8GiB --reps 3 --batches 4,16 --out $OUT 2>&1 | grep -v "^USDT" | tail -12
step tests
left=$(( D - $(date +%s) - 10 )); [ $left -gt 30 ] && SLIPSTREAM_TEST_DEVICE=cuda timeout $left python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_moe_host_path.py tests/engine/test_moe.py tests/engine/test_cuda_graphs.py tests/engine/test_moe_stream.py > $W/tests.txt 2>&1; tail -3 $W/tests.txt
step pack
tar cJf $OUT/callkk.tar.xz -C $W .
