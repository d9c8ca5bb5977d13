#!/bin/bash
# Session 21, call AC (run as `BUDGETS=4GiB bash carry/callac.sh`, the last device minutes; about 1.5 min a budget).
# Where the CPU side of the Llama-3-8B
# decode loses a quarter of its probed rate (session 21's call Z: a CPU FFN took 4.55-4.97 ms of host time in
# the decode, 3.28 priced, 3.7 for the call alone beside copies in session 17). The executor's sub-layer timer
# (wall time per kind, waits included) beside the native layer calls' own phase timers in the same runs
# (share_ab --phases, new): the difference per kind is what happens outside the calls (the pool's wake-up,
# the waits for the GPU before a CPU sub-layer, Python between calls). 4 GiB, then 8 GiB; the lease's rates
# first. Afterwards: the README's session section, and the estimator's CPU prices if the calls themselves are
# slow.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callac; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
python3 -c "from engine.bench.gpu_common import rates_probe; print('rates', rates_probe())" | tee $W/rates.txt
for b in ${BUDGETS:-4GiB 8GiB}; do
  timeout 150 python3 -m engine.bench.share_ab --shape llama3-8b --budget $b --moves none --rounds 3 \
    --parts decode,batch --host-times --phases --out $W/$b > $W/$b.log 2>&1; echo "$b rc=$?"
  grep -v "^USDT" $W/$b.log | tail -3
done
tar cJf $OUT/callac.tar.xz -C $W .
