#!/bin/bash
# Session 21, call Z (about 5 min): why Llama-3-8B's 4-stream batch decodes slower at 4 GiB (call W: 26.8
# tokens/s, its tier-4 plan predicted 122 ms a step, so 32.7) than at 2 GiB (31.0, predicted 28.7). The
# executor's sub-layer timer over the batches (share_ab --host-times, now for batches too), at 4 GiB with the
# planner's plans beside the same plans with the first four layers' attention resident (4 GiB keeps every
# layer's KV in host memory: the 2 GiB plans keep the first four in VRAM with their attention), then at 2 GiB.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callz; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "4 GiB"
timeout 260 python3 -m engine.bench.share_ab --shape llama3-8b --budget 4GiB --moves "none;layers.[0-3].attn=resident" \
  --rounds 3 --parts decode,batch --host-times --out $W/b4 > $W/b4.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/b4.log | tail -6
step "2 GiB"
timeout 150 python3 -m engine.bench.share_ab --shape llama3-8b --budget 2GiB --moves "none" \
  --rounds 2 --parts decode,batch --host-times --out $W/b2 > $W/b2.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/b2.log | tail -4
step pack
tar cJf $OUT/callz.tar.xz -C $W .
