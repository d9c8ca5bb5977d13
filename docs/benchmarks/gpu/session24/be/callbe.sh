#!/bin/bash
# Session 23's next call, BE (written, not run; about 8 min): what session 23 changed after its last GPU call.
# 1) transfer_code_rate (its fixed decode-alone row, the host time to issue a copy: issue_us); coded_matmul (the
#    native CPU matmul reading coded matrices in place against raw: on this host's 16 cores, does it gain?).
# 2) The CUDA tests of transfer coding and the executor (the store now packs its coded buffers into a few
#    pinned chunks after a counting pass; the CUDA decode is checked at open and a failure leaves raw streaming).
# 3) The suite's Llama rows at 4 GiB with transfer coding on, the CPU's native calls (FFN, attention, head)
#    reading raw and coded weights (SLIPSTREAM_CPU_CODED=0/1), processes taking turns (raw, coded, coded,
#    raw): the decode's CPU side reads 25% fewer bytes where the coded matmul keeps up; the estimator still prices raw bytes, so
#    the plans are the same. Also the open time against call BC's 42 s and each process's peak RSS (the coded
#    copy should add about 0.75 x 15 GB, no more).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbe; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "rate"
timeout 90 python3 -m engine.bench.transfer_code_rate --mib 448 --reps 10 --out $W/rate > $W/rate.log 2>&1; echo "rc=$?"
grep -v USDT $W/rate.log | tail -7
step "the CPU matmul over coded matrices (16 cores)"
timeout 60 python3 -m engine.bench.coded_matmul --out $W/coded_matmul > $W/coded_matmul.log 2>&1; echo "rc=$?"
tail -7 $W/coded_matmul.log
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_transfer_code.py tests/engine/test_executor.py 2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt
tail -6 $W/tests.txt
i=0; TIMEV=$([ -x /usr/bin/time ] && echo "/usr/bin/time -v")    # (peak RSS where GNU time is there)
for v in 0 1 1 0; do
  i=$((i+1)); step "llama3-8b 4GiB, coding on, the CPU reading coded FFNs: $v ($i)"
  SLIPSTREAM_TRANSFER_CODE=1 SLIPSTREAM_CPU_CODED=$v $TIMEV timeout 150 python3 -m engine bench --gpu --part slipstream \
    --models llama3-8b --budgets 4GiB --out $W/s$i-$v > $W/s$i-$v.log 2>&1; echo "rc=$?"
  grep -h "slipstream llama3-8b\|opened\|Maximum resident" $W/s$i-$v.log | tail -3
done
step pack
tar cJf $OUT/callbe.tar.xz -C $W .
