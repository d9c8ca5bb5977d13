#!/bin/bash
# Session 7, call D: the suite's Slipstream rows (Llama-3-8B, Qwen3-30B-A3B shapes) with the engine at d118025.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
D=$(( $(date +%s) + ${BUDGET_S:-300} ))
python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out /tmp/cd --deadline-epoch $D 2>&1 | tail -12
cp /tmp/cd/part-slipstream.json $OUT/; tar cJf $OUT/calld7.tar.xz -C /tmp/cd .
