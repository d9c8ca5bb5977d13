#!/bin/bash
# Session 12, call Z: the ordered add of a prompt's expert outputs split across the pool, the expert-job
# table drawn with Poisson row counts, and the ops around the jobs priced by the bytes they move. The
# profile again (the table changed), the CPU experts of 512 tokens, the MoE tier-1024 step per plan kind
# against its prediction (24 layers, 2 and 4 GiB), then the MoE suite rows.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callz; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-440} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_PROFILE_DB=/tmp/test-profile.json SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_moe_host_path.py tests/engine/test_estimator.py 2>&1 | grep -v "^  *File\|^$" | tail -20 > $W/tests.txt; tail -3 $W/tests.txt
step profile
export SLIPSTREAM_PROFILE_DB=$W/h200-profile.json
timeout 150 python3 -m engine profile --device cuda > $W/profile.txt 2>&1; python3 -c "
import json; d = json.load(open('$W/h200-profile.json')); p = next(iter(d['profiles'].values())); print(p['cpu'].get('experts', {}).get('bfloat16'))"
step experts
timeout 40 python3 -m engine.bench.moe_cpu_experts --batches 512 --tokens 8 --out $W/experts 2>&1 | grep "batch" | cut -c1-230
step accuracy
timeout 150 python3 -m engine.bench.planner_accuracy --shape qwen3-30b-a3b --layers 24 --budgets 2GiB,4GiB --tiers 1024 --kinds gpu_only,dynamic --reps 2 --out $W/acc 2>&1 | grep "tier\|median" | tail -6
step suite
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -10
cp $W/suite/part-slipstream.json $W/h200-profile.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callz.tar.xz -C $W .
