#!/bin/bash
# Session 18, call G (on call F's held lease, whose llama.cpp build it reuses): the llama.cpp rows at 4 GiB that
# call F's llamacpp part skipped (its --prior took the committed rows as done). Run as one command line:
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD; W=/tmp/callf; D=$(( $(date +%s) + 270 ))
python3 -m engine bench --gpu --part llamacpp --models llama3-8b --budgets 4GiB --no-batched --tuned nommap+attn-gpu \
  --llamacpp-prompts 512 --out $W/llamacpp2 --deadline-epoch $D > $W/llamacpp2.log 2>&1; echo rc=$?
grep -v "^USDT" $W/llamacpp2.log | tail -12; cp $W/llamacpp2/part-llamacpp.json $OUT/part-llamacpp-4gib-g.json
tar cJf $OUT/callg.tar.xz -C $W llamacpp2 llamacpp2.log
