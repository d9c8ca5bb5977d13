#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
timeout 130 python3 carry/ab_attn.py 8GiB 2>&1 | grep "t/s\|rror" | tee $OUT/ab_attn.txt
