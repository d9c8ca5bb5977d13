#!/bin/bash
# Next call (written in session 14, not run; about 9.5 min): (1) accelerate's MoE rows on the weights whose
# routing spreads (session 14's call GG spent 533 s drawing them on the CPU; they are drawn on the GPU now);
# (2) the MoE decode at 4 and 8 GiB with the CPU layer call, token by token and traced (a range per
# sub-layer: where a 38 ms step goes, against about 30 ms of CPU expert bandwidth, attention and crossings;
# and why 8 GiB, with four more layers in VRAM, decoded slower than 4 GiB in one engine in call II);
# (3) with what time is left, the MoE shape's 512- and 4096-token prompts at 2 GiB timed step by step and
# profiled (session 13's 4096-token prompt took 1.04 s against 0.58 predicted). Copy this,
# gpu/session12/diag_prefill.py, the profile (as h200-profile.json) and gpu/issue6/part-accelerate.json less
# its qwen3-30b-a3b rows (as carry/bench/part-accelerate.json) into carry/ first.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callmm; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { echo $(( D - $(date +%s) - ${1:-0} )); }
step accelerate
python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --out $OUT --prior carry/bench --deadline-epoch $((D-290)) 2>&1 | tee $W/accelerate.log | grep "accelerate\|rror\|deadline" | tail -8
step "decode trace"
t=$(left 90); [ $t -gt 60 ] && timeout $(( t < 200 ? t : 200 )) python3 -m engine.bench.decode_steps --shape qwen3-30b-a3b --budgets 4GiB,8GiB --tokens 24 --profile-steps 2 --late-token 8 --out $W/decode 2>&1 | grep "^==\|opened"
step "diag moe"
t=$(left 8); [ $t -gt 60 ] && timeout $t python3 carry/diag_prefill.py qwen3-30b-a3b 2GiB 24 512,4096 > $W/diag-moe.txt 2>&1; grep -A6 '^==' $W/diag-moe.txt | head -24
step pack
tar cJf $OUT/callmm.tar.xz -C $W .
