#!/bin/bash
# Session 19, call M (the last ~3 min of device time): the MoE decode at 2 GiB traced with the current code
# (decode_steps: each token's time against the plan's prediction, and a few late steps traced), to split the
# 13-15 ms of a 29-31 ms token that are not the CPU experts' layer calls (call I).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
cp carry/h200-profile.json /tmp/profile.json; export SLIPSTREAM_PROFILE_DB=/tmp/profile.json
mkdir -p $OUT/decode
timeout ${BUDGET_S:-170} python3 -m engine.bench.decode_steps --shape qwen3-30b-a3b --budgets 2GiB --tokens 48 \
  --late-token 36 --profile-steps 2 --out $OUT/decode > $OUT/decode_steps.log 2>&1; echo "rc=$?"
grep -v "^USDT" $OUT/decode_steps.log | tail -15
for f in $OUT/decode/*late*.json.gz; do [ -f "$f" ] && python3 -m engine.bench.trace_breakdown "$f" --top 5 > $OUT/breakdown.txt 2>&1; done
head -60 $OUT/breakdown.txt 2>/dev/null
