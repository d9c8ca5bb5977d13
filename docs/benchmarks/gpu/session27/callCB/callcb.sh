#!/bin/bash
# Session 27, call CB (about 2.5 min): the tight code's plan (call BY) put the four resident attentions on the
# CPU, priced 95.7 against 96.9 ms, and its decode measured slower. Here, at the 4-bit code: the planner's plan
# against the same plan with every attention on the CPU, in turns in one engine (Llama-3-8B, 4 GiB).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
cp carry/h200-profile.json /tmp/profile.json; export SLIPSTREAM_PROFILE_DB=/tmp/profile.json
timeout 190 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 4 --tokens 48 \
  --cpu-variants "none,layers.*.attn" --order abba --out $OUT/attn > $OUT/attn.log 2>&1; echo "rc=$?"
grep "^|" $OUT/attn.log | cut -c1-220 | head -8
