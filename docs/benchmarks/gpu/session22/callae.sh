#!/bin/bash
# Session 22, call AE (written in session 21; about 6 min). The MoE decode's host time per kind of
# sub-layer at 2, 4 and 8 GiB (the executor's sub-layer timer, `share_ab --host-times`), for re-pricing the
# estimator's MoE decode (43.1 ms predicted at 2 GiB against 29-31 measured; HOWTO_GPU, session 21: the
# one-call CPU layer and the GPU MoE layer are both over-priced). Then, here: `python -m engine.bench.price_check
# x/<budget>/share_ab.json --profile-file docs/benchmarks/profiles/h200.json` (each kind's measured ms beside
# `step_costs`; a CPU router's row holds its one-call layer), and the plans the re-priced estimator picks, set
# beside today's on the GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callae; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
python3 -c "from engine.bench.gpu_common import rates_probe; print('rates', rates_probe())" | tee $W/rates.txt
for b in 2GiB 4GiB 8GiB; do
  timeout 110 python3 -m engine.bench.share_ab --shape qwen3-30b-a3b --budget $b --moves none --rounds 2 \
    --parts decode --host-times --out $W/$b > $W/$b.log 2>&1; echo "$b rc=$?"
  grep -v "^USDT" $W/$b.log | tail -3
done
tar cJf $OUT/callae.tar.xz -C $W .
