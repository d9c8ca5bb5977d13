#!/bin/bash
# Session 21, call AB (about 4 min): the decode tiers planned apart from the prompts' (`split_plans`, off by
# default) at the MoE shape's 2 GiB, again: session 20's call O ran the "apart" runs beside the NVML poller,
# and its re-runs (calls P, Q) ran out of memory at the switch, which expandable segments (on by default since
# call Y) let through. Runs taking turns (abba), no poller.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callab; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
timeout 280 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 8 --order abba \
  --split-variants off,on --out $W/moe2 > $W/moe2.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/moe2.log | grep -E "^\| [0-9]|Error|error" | cut -c1-200 | tail -10
tar cJf $OUT/callab.tar.xz -C $W .
