#!/bin/bash
# Session 15, call PP (about 6.5 min). (1) Llama-3-8B's decode at 4 GiB as the suite runs it, token by token
# and traced (engine.bench.decode_steps): call NN's suite decoded at 7.90 t/s (126.6 ms) with a plan predicted
# at 114.7 ms, while its A/B engine, without the suite's cached 4096-token prompt and with the head resident,
# ran 8.78 t/s (113.9 ms) against 111.8 predicted. (2) The MoE decode at 4 and 8 GiB token by token and traced
# (engine.bench.decode_steps), for why 8 GiB decodes slower than 4 GiB (call KK's suite: 28.8 against 29.7
# t/s; 37 expert groups resident at 8 GiB, 8 at 4 GiB; llama.cpp-tuned too: 24.9 against 28.9).
# Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callpp; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-400} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { local t=$(( D - $(date +%s) - ${1:-0} )); echo $(( t > 30 ? t : 30 )); }
step "Llama decode trace"
timeout 150 python3 -m engine.bench.decode_steps --shape llama3-8b --budgets 4GiB --tokens 32 --profile-steps 2 --late-token 8 --out $W/llama 2>&1 | grep -v "^USDT" | tail -24
step "MoE decode trace"
timeout $(left 10) python3 -m engine.bench.decode_steps --shape qwen3-30b-a3b --budgets 4GiB,8GiB --tokens 24 --profile-steps 2 --late-token 8 --out $W/decode 2>&1 | grep -v "^USDT" | tail -20
step pack
tar cJf $OUT/callpp.tar.xz -C $W .
