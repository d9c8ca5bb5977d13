#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
D=$(( $(date +%s) + ${BUDGET_S:-240} ))
python3 -m engine bench --gpu --part slipstream --models ${MODELS:-llama3-8b} --out $OUT --deadline-epoch $D 2>&1 | tail -6
