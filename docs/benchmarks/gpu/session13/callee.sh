#!/bin/bash
# A call after calldd (written in session 13, not run; about 9 min): the CUDA test fixed after call CC; the
# MoE shape's 512- and 4096-token prompts at 2 GiB timed step by step and profiled, with pinned state moves
# (to price them again: estimator.STATE_MOVE_GBPS is session 12's pageable rate; and the 4096-token prompt
# took 1.04 s in call CC where its plan predicts 0.58); the estimator against measured MoE steps at
# tiers 64/256/1024 (4 GiB, dynamic and gpu_only); then accelerate's MoE rows on the new weights.
# Copy this, gpu/session12/diag_prefill.py and docs/benchmarks/profiles/h200.json (as h200-profile.json)
# into carry/ first.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callee; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_moe_host_path.py 2>&1 | tail -20 > $W/tests.txt; tail -2 $W/tests.txt
step "diag moe"
timeout 150 python3 carry/diag_prefill.py qwen3-30b-a3b 2GiB 24 512,4096 2>&1 > $W/diag-moe.txt; grep -A6 '^==' $W/diag-moe.txt | head -20
grep "packed_move\|_move)\|to_host\|to_device" $W/diag-moe.txt | head -6
step accuracy
timeout 200 python3 -m engine.bench.planner_accuracy --shape qwen3-30b-a3b --layers 24 --budgets 4GiB --tiers 64,256,1024 --kinds dynamic,gpu_only --reps 2 --out $W/acc 2>&1 | tail -12
step accelerate
python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --out $OUT --deadline-epoch $((D-5)) 2>&1 | grep "accelerate\|rror" | tail -6
step pack
tar cJf $OUT/callee.tar.xz -C $W .
