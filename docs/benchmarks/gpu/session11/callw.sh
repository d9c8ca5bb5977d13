#!/bin/bash
# The vision-language rows (written in session 11, not run): `--part vl`, the Qwen2.5-VL-7B shape with a
# 2560x1440 picture, Slipstream and accelerate per budget (about 3.5-4.5 min a budget); run it twice, the
# second time after `cp <files>/part-vl.json carry/bench/` so --prior skips the rows done.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
D=$(( $(date +%s) + ${BUDGET_S:-560} ))
python3 -m engine bench --gpu --part vl --out $OUT --prior carry/bench --deadline-epoch $D 2>&1 | grep -v "^ *\^" | tee $OUT/call-vl.log | grep "vl \|rror\|TTFT\|deadline" | tail -20
