#!/bin/bash
# Session 25's next call, BQ (written, not run; about 6 min). The MoE 2 GiB row's batched decode read 36.3 / 71.0
# t/s in call BK against 44.7 / 80.6 in session 23's call BC (single-stream 31.5 against 33.8), on leases whose
# probes read alike. Between them: the copy issuer thread (session 24: it sets the interpreter's switch interval
# to 0.2 ms while it runs). The suite's MoE 2 GiB row with the issuer off, then on, in two processes.
# Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbq; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
for issuer in 0 1; do
  echo "=== issuer $issuer ($(( $(date +%s) - T0 )) s)"
  SLIPSTREAM_COPY_ISSUER=$issuer python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB \
    --out $W/issuer-$issuer --deadline-epoch $(( issuer == 0 ? D - 270 : D - 5 )) > $W/issuer-$issuer.log 2>&1
  echo "rc=$?"; grep -h "slipstream qwen3\|opened\|Error" $W/issuer-$issuer.log | tail -3
  cp $W/issuer-$issuer/part-slipstream.json $OUT/part-slipstream-moe-2gib-issuer$issuer.json 2>/dev/null
done
tar cJf $OUT/callbq.tar.xz -C $W .
