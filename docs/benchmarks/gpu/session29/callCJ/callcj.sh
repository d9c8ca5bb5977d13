#!/bin/bash
# Session 29, call CJ (up to 5.5 min). Copy into carry/ with the profile (h200-profile.json).
# Calls CG, CH and CI each met 7-15% CPU steal at the lease probe. The MoE rows at 2, 4 and 8 GiB again, after
# up to three probes 15 s apart waiting for a quiet CPU (steal under 3%); the probes are kept either way.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callcj; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-330} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
for i in 1 2 3; do
  python3 -c "
import json, sys
from engine.bench.gpu_common import lease_probe
p = lease_probe(); print(json.dumps(p)); sys.exit(0 if p['steal_share'] < 0.03 else 3)" >> $W/probes.jsonl && break
  sleep 15
done
tail -n 3 $W/probes.jsonl | cut -c1-200
step "MoE rows, 2, 4 and 8 GiB"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB,4GiB,8GiB --out $W/moe \
  --deadline-epoch $((D-5)) > $W/moe.log 2>&1; echo "rc=$?"
grep -h "lease probe\|rates \|slipstream qwen3\|Error" $W/moe.log | cut -c1-300 | tail -7
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step pack
tar cJf $OUT/callcj.tar.xz -C $W .
