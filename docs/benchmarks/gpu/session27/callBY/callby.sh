#!/bin/bash
# Session 26's next call, BY (written, not run; about 7 min). Copy into carry/ with the profile (h200-profile.json).
# Tight transfer coding (written after session 26's last call: SLIPSTREAM_TRANSFER_CODE_TIGHT=1, off by default):
# a sign plane, a 2-bit code and a second stream of 4-bit codes found by a prefix sum per 1024-word block; 70.9%
# of a normal bf16 matrix's bytes against 75.1% (this machine). 0) its CUDA tests (the fused Triton decode passes
# its warm-up check and gives a 6 MB buffer's bytes back; a tight stream gives the raw stream's logits and
# tokens); 1) the suite's Llama-3-8B 4 GiB row in processes taking turns, tight, 4-bit, tight (the 512-token
# prefill is PCIe-bound: about 5% expected there, about 2% on the decode). Opening codes the weights with the native
# tight encoder (about 0.2 s per 64 MiB on 2 cores; the 4-bit form's 0.07 s).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callby; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-550} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_transfer_code.py \
  > $W/tests.txt 2>&1
grep "Failed\|passed\|failed" $W/tests.txt | cut -c1-600 | tail -4; cp $W/tests.txt $OUT/
k=0
for t in 1 0 1; do
  k=$((k + 1)); left=$(( D - $(date +%s) )); [ $left -lt 110 ] && { echo "(out of time before run $k)"; break; }
  step "suite row, Llama 4 GiB, tight=$t"
  SLIPSTREAM_TRANSFER_CODE_TIGHT=$t python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB \
    --out $W/row-$k-tight$t --deadline-epoch $((D-5)) > $W/row-$k-tight$t.log 2>&1; echo "rc=$?"
  grep -h "slipstream llama3-8b\|opened" $W/row-$k-tight$t.log | cut -c1-200 | tail -2
  cp $W/row-$k-tight$t/part-slipstream.json $OUT/part-slipstream-4gib-$k-tight$t.json 2>/dev/null
done
step pack
tar cJf $OUT/callby.tar.xz -C $W .
