#!/bin/bash
# Session 18, call H (on the same held lease): the Slipstream row and the llama.cpp rows at 4 GiB once more, one
# after the other. Run as one command line:
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD SLIPSTREAM_PROFILE_DB=$PWD/carry/h200-profile.json
W=/tmp/callh; mkdir -p $W; D=$(( $(date +%s) + 240 ))
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB --out $W/slipstream \
  --deadline-epoch $((D-40)) > $W/slipstream.log 2>&1; echo rc=$?; grep -v "^USDT" $W/slipstream.log | tail -4
python3 -m engine bench --gpu --part llamacpp --models llama3-8b --budgets 4GiB --no-batched --tuned nommap+attn-gpu \
  --llamacpp-prompts 512 --out $W/llamacpp --deadline-epoch $D > $W/llamacpp.log 2>&1; echo rc=$?
grep -v "^USDT" $W/llamacpp.log | tail -5
cp $W/llamacpp/part-llamacpp.json $OUT/part-llamacpp-4gib-h.json; cp $W/slipstream/part-slipstream.json $OUT/part-slipstream-4gib-h.json
tar cJf $OUT/callh.tar.xz -C $W .
