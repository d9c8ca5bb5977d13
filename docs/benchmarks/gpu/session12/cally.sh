#!/bin/bash
# Session 12, call Y: the smaller head scratch where it changes plans (Llama-3-8B's tiers 256/1024 at
# 2 GiB; the Qwen2.5-VL-7B shape at 2 GiB, whose 4,700-token prompt had run its FFNs on the CPU), the
# Llama 2 GiB prefill step timed per tier against its prediction, then the Llama suite rows.
# Needs carry/h200-profile.json (call X's profile: the fingerprint of this code).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/cally; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-520} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step vl
python3 -m engine bench --gpu --part vl --vl-systems slipstream --budgets 2GiB --out $W/vl --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "vl \|rror\|TTFT\|plan" | tail -8
step accuracy
timeout 100 python3 -m engine.bench.planner_accuracy --shape llama3-8b --budgets 2GiB --tiers 1024,4096 --kinds dynamic --reps 2 --out $W/acc 2>&1 | tail -8
step suite
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -10
cp $W/suite/part-slipstream.json $W/vl/part-vl.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/cally.tar.xz -C $W .
