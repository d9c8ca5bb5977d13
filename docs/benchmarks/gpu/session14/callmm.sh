#!/bin/bash
# Next call (written in session 14, not run; about 8 min): accelerate's MoE rows on the weights whose routing
# spreads (session 14's call GG spent 533 s drawing them on the CPU; they are drawn on the GPU now), then the
# MoE shape's 512- and 4096-token prompts at 2 GiB timed step by step and profiled (session 13's 4096-token
# prompt took 1.04 s against 0.58 predicted). Copy this, gpu/session12/diag_prefill.py, the profile (as
# h200-profile.json) and gpu/issue6/part-accelerate.json less its qwen3-30b-a3b rows (as
# carry/bench/part-accelerate.json) into carry/ first.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callmm; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-540} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step accelerate
python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --out $OUT --prior carry/bench --deadline-epoch $((D-170)) 2>&1 | tee $W/accelerate.log | grep "accelerate\|rror\|deadline" | tail -8
step "diag moe"
left=$(( D - $(date +%s) - 8 )); [ $left -gt 60 ] && timeout $left python3 carry/diag_prefill.py qwen3-30b-a3b 2GiB 24 512,4096 > $W/diag-moe.txt 2>&1; grep -A6 '^==' $W/diag-moe.txt | head -24
step pack
tar cJf $OUT/callmm.tar.xz -C $W .
