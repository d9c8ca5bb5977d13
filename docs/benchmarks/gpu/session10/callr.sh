#!/bin/bash
# The call after callq.sh (written in session 10, not run): the Llama-3-8B suite rows with the captured
# attention on by default and the batched rows' new count, then the MoE budgets callq.sh left (--prior).
# Before it: mkdir -p carry/bench && cp <callq files>/part-slipstream.json carry/bench/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-540} ))
python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $OUT --prior carry/bench --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -10
