#!/bin/bash
# Session 15, call OO (about 9.5 min).
# (1) Call NN's suite decoded Llama-3-8B at 4 GiB at 7.90 t/s (114.7 ms predicted; session 13's suite
#     8.51-8.66 with the same plan), while its A/B engine, at another plan (the head resident: no 4096-token
#     prompt cached), gave 8.78 both with and without the CPU attention and FFN calls. Here the A/B runs in
#     the suite's state: the suite's context, a 4096-token prompt first at each budget (its KV stays cached
#     and the plan counts it), budgets ascending as the suite.
# (2) The same for the MoE layer call at 2 GiB: call KK's suite decoded at 18.8 t/s there, its A/B engine at
#     26.8 with the call and 18.4 without, but that engine's plan report was read before the 2 GiB plan came
#     in. Both A/Bs print how many plan tables the engine priced in a background thread by then.
# (3) accelerate's MoE rows on the current weights (drawn on the GPU since session 14; the carried
#     part-accelerate.json holds only the dense rows).
# Copy this, the profile (h200-profile.json) and bench/part-accelerate.json (without its qwen3-30b-a3b
# rows) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/calloo; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { local t=$(( D - $(date +%s) - ${1:-0} )); echo $(( t > 30 ? t : 30 )); }
step "dense calls A/B in the suite's state"
timeout 170 python3 -m engine.bench.moe_layer_ab --shape llama3-8b --layers 0 --calls dense --budgets 2GiB,4GiB --n-ctx suite --long-prompt 4096 --reps 3 --tag llama-suite-state --out $OUT 2>&1 | grep -v "^USDT" | tail -6
step "MoE layer call A/B in the suite's state, 2 GiB"
timeout 140 python3 -m engine.bench.moe_layer_ab --layers 24 --budgets 2GiB --n-ctx suite --long-prompt 4096 --reps 3 --tag moe-suite-state --out $OUT 2>&1 | grep -v "^USDT" | tail -3
step accelerate
timeout $(left 8) python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --out $W/acc --prior carry/bench --deadline-epoch $((D-8)) 2>&1 | tee $W/accelerate.log | grep -v "^USDT" | grep "accelerate\|rror\|deadline" | tail -8
cp $W/acc/part-accelerate.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/calloo.tar.xz -C $W .
