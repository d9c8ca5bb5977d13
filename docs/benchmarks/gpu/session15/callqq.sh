#!/bin/bash
# Session 15, call QQ (about 2 min): the MoE decode at 4 and 8 GiB after the planner keeps MoE layers whole
# in VRAM for steps of up to 16 tokens (estimator.PARTIAL_MOE_LAYER_MS; call PP: 8 GiB's plan kept 37 groups,
# four whole layers and 5 groups of a fifth, and decoded at 36.3 ms a token against 32.5 at 4 GiB).
# engine.bench.decode_steps without traces: the suite's prompts, then 32 tokens timed one by one.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callqq; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
timeout ${BUDGET_S:-170} python3 -m engine.bench.decode_steps --shape qwen3-30b-a3b --budgets 8GiB,4GiB --tokens 32 --no-decode-traces --out $W/decode 2>&1 | grep -v "^USDT" | tail -6
tar cJf $OUT/callqq.tar.xz -C $W .
