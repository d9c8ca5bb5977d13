#!/bin/bash
# Next call (written in session 14, not run; about 9 min): the CPU calls for dense layers on the GPU machine,
# for the Llama-3-8B decode target (4 GiB: 0.71x the bound, target 0.75x; its plan runs 28 attentions and 13
# FFNs on the CPU): the one-token attention call (kernels.attention_decode: norm, projections, q/k norms,
# RoPE, cache write, attention and output projection in one native call) and the dense FFN call
# (kernels.ffn_layer). (1) The decode A/B alternating in one engine at 4, 2 and 8 GiB (greedy tokens must
# match); (2) the suite's Llama rows with them (put them into gpu/issue6 with engine.bench.part_replace
# --models llama3-8b). Copy this and the profile (as h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callnn; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "attention call A/B"
timeout 220 python3 -m engine.bench.moe_layer_ab --shape llama3-8b --layers 0 --calls dense --budgets 4GiB,2GiB,8GiB --reps 3 --tag llama-dense --out $OUT 2>&1 | grep -v "^USDT" | tail -10
step suite
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/suite --deadline-epoch $((D-8)) 2>&1 | grep -v "^USDT" | tail -12
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callnn.tar.xz -C $W .
