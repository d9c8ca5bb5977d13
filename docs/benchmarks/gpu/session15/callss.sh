#!/bin/bash
# Next call (written in session 15, not run; about 8 min). (1) The MoE decode at 2 GiB as the suite runs it,
# token by token and traced (engine.bench.decode_steps): call KK's suite row decoded at 18.81 t/s (runs 18.8,
# 18.5, 25.9) against 43.1 ms (23.2 t/s) predicted; its plan keeps every attention in VRAM and the head and
# all expert groups on the CPU. (2) The CPU attention and FFN layer calls phase by phase on this host
# (engine.bench.cpu_call_phases): call PP's trace had a CPU attention at 1.57 ms for 84 MB (53 GB/s) against
# a CPU FFN at 4.53 ms for 352 MB (78 GB/s); on the 2-core machine both calls run at their matmuls' rate.
# (3) accelerate's MoE row at 8 GiB on the current weights (copy gpu/issue6/part-accelerate.json without its
# qwen3-30b-a3b 8GiB row into carry/bench/). Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callss; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { local t=$(( D - $(date +%s) - ${1:-0} )); echo $(( t > 30 ? t : 30 )); }
step "MoE 2 GiB decode trace"
timeout 200 python3 -m engine.bench.decode_steps --shape qwen3-30b-a3b --budgets 2GiB --tokens 32 --profile-steps 2 --late-token 8 --out $W/decode 2>&1 | grep -v "^USDT" | tail -24
step "CPU call phases"
timeout 90 python3 -m engine.bench.cpu_call_phases --shape llama3-8b --reps 200 --out $W 2>&1 | tail -18
step accelerate
timeout $(left 8) python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --budgets 8GiB --out $W/acc --prior carry/bench --deadline-epoch $((D-8)) 2>&1 | tee $W/accelerate.log | grep -v "^USDT" | grep "accelerate\|rror\|deadline" | tail -8
cp $W/acc/part-accelerate.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callss.tar.xz -C $W .
