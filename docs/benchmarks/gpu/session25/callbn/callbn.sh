#!/bin/bash
# Session 25, call BN (about 3.5 min): call BM's Llama 4 GiB decode read 8.08 t/s (steps 121-127 ms against
# 93-97 in call BJ) while the lease's CPU probe fell from 121 to 91 GB/s over the row. Today's engine against
# session 24's last commit (carry/old), alternating processes: new, old, new.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
W=/tmp/callbn; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
for which in new old new; do
  if [ $which = new ]; then P=$PWD; else P=$PWD/carry/old; fi
  echo "=== $which ($(date +%T))"
  (cd $P && PYTHONPATH=$P timeout 85 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 3 \
    --tokens 32 --out $W/$which-$(date +%s) 2>&1 | grep -v USDT | grep -i "t/s\|tps\|run\|error" | tail -8)
done
tar cJf $OUT/callbn.tar.xz -C $W .
