#!/bin/bash
# Session 14, call JJ (about 3 min, what device time was left): the suite's MoE row at 2 GiB with the CPU
# layer call, after call II's suite run stopped at its first budget (the engine's bookable VRAM had shrunk
# to 590 MiB: the process overhead grew after open). The routing's GPU top k is back to topk for this call
# (call II's had a stable sort on the GPU too). Copy this and the profile (as h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/calljj; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-170} ))
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB --out $W/suite --deadline-epoch $((D-5)) 2>&1 | grep -v "^USDT" | tail -14
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
tar cJf $OUT/calljj.tar.xz -C $W .
