#!/bin/bash
# Session 21, call X (about 5 min): the MoE decode at 2 GiB with the head resident. The planner's 2 GiB plan
# keeps 18 attentions resident, streams 6 and computes the head on the CPU (622 MB, about 6 ms of a 31 ms
# token in session 19's trace); its family never makes the head resident before every GPU attention is.
# Set beside it in one engine, runs taking turns (abba): the head resident with every attention streamed,
# and the head resident with every attention on the CPU (`move_to_cpu` "PATTERN=PLACE" entries, new).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callx; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
timeout 400 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 9 --order abba \
  --cpu-variants "none,head=resident+layers.*.attn=streamed,head=resident+layers.*.attn=cpu" --out $W/moe2 2>&1 \
  | grep -v "^USDT" | tail -14
tar cJf $OUT/callx.tar.xz -C $W .
