#!/bin/bash
# Session 20, call S (the lease of call R, still warm; 2 min): call R's MoE 2 GiB A/B again with 12 runs,
# the lease's rates probed first. (Run as one command line; written down here as it ran.)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD SLIPSTREAM_PROFILE_DB=/tmp/callr/profile.json
mkdir -p /tmp/calls
python3 -c "from engine.bench.gpu_common import rates_probe; print('rates', rates_probe())" | tee /tmp/calls/rates.txt
timeout 170 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 12 --host-io-variants off,on \
  --out /tmp/calls/moe-2GiB > /tmp/calls/moe-2GiB.log 2>&1; echo rc=$?
grep -v USDT /tmp/calls/moe-2GiB.log | grep -E "^\| [0-9]|rror" | cut -c1-150
tar cJf $OUT/calls.tar.xz -C /tmp/calls .
