#!/bin/bash
# Session 13, call CC: the MoE rows of Slipstream on weights whose tokens spread over the experts (as the
# llama.cpp rows of call BB), with state and hidden moves through pinned memory (engine/models/transfer.py).
# - CUDA tests of the pinned moves and the MoE paths;
# - with DIAG=1: a 512-token prompt of the MoE shape at 2 GiB, steps timed and profiled (carry/diag_prefill.py);
# - the suite's MoE rows (2/4/8 GiB), then the Llama 4 GiB row (do pinned moves change a dense decode?);
# - with ACC=1: the estimator against measured steps of MoE tiers 64/256/1024 at 4 GiB, by plan kind.
# Run in session 13 as BUDGET_S=330 (no DIAG, no ACC: the device time left).
# Copy this, gpu/session12/diag_prefill.py and docs/benchmarks/profiles/h200.json (as h200-profile.json)
# into carry/ first.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callcc; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-330} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_moe_host_path.py tests/engine/test_moe.py tests/engine/test_executor.py 2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt; tail -4 $W/tests.txt
[ -n "$DIAG" ] && { step "diag moe"
timeout 110 python3 carry/diag_prefill.py qwen3-30b-a3b 2GiB 24 512 2>&1 | tee $W/diag-moe.txt | head -8
grep "packed_move\|_move)\|to_host\|to_device" $W/diag-moe.txt | head -6; }
step suite
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $(( D - 80 )) 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -6
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step "llama 4GiB"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB --out $W/suite-llama --deadline-epoch $(( D - 5 )) 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -3
step accuracy
R=$(( D - $(date +%s) - 10 )); [ -n "$ACC" ] && [ $R -gt 60 ] && timeout $R python3 -m engine.bench.planner_accuracy --shape qwen3-30b-a3b --layers 24 --budgets 4GiB --tiers 64,256,1024 --kinds dynamic,gpu_only --reps 2 --out $W/acc 2>&1 | tail -12
step pack
tar cJf $OUT/callcc.tar.xz -C $W .
