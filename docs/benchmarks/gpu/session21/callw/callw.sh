#!/bin/bash
# Written in session 20 for the next session (not run; about 8 min): the suite's Llama-3-8B rows again (the
# batch rows put CPU decode attention through one native call since session 19: the 4 GiB batch-4 row reads
# 27.0 t/s, 0.95x llama.cpp-default's), then part_replace --models llama3-8b --archive session18 and the
# merge. The lease's rates are probed first (the rows' spread follows the lease).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callw; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-580} ))
python3 -c "from engine.bench.gpu_common import rates_probe; print('rates', rates_probe())" | tee $W/rates.txt
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/slipstream \
  --deadline-epoch $((D-6)) > $W/slipstream.log 2>&1; echo "rc=$?"; grep -v "^USDT" $W/slipstream.log | tail -8
cp $W/slipstream/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
tar cJf $OUT/callw.tar.xz -C $W .
