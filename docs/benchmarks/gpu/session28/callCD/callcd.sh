#!/bin/bash
# Session 27's next call, CD (written, not run; about 7.5 min). Copy into carry/ with the profile (h200-profile.json).
# The native CPU matmul now prefetches rows of 4096+ elements 512 elements ahead (written after session 27's
# last call; on by default; SLIPSTREAM_KERNEL_PREFETCH=0 off). On the 2-core AMD machine here: the FFN block
# 32.8 -> 45.5 GB/s, a 6-layer Llama-3-8B CPU decode 10.45 -> 15.62 t/s. The H200 host is Intel, 16 threads,
# memory read 88-124 GB/s: 1) cpu_matmul with the distance off and on in turns (8 and 16 rows too: past 4 rows
# bf16 goes to PyTorch on AMX hosts, kernels.MAX_ROWS_AMX_BF16, which prefetching may move); 2) the Llama-3-8B 4 GiB decode
# with the distance off and on in turns in one engine (abba); 3) the same with the CPU reading the coded weights
# (SLIPSTREAM_CPU_CODED=1: 0.58-0.81x on this host before, when its coded matmul was starved of reads the way
# prefetching fixed here: 0.61-0.69x -> 0.96-1.07x at one row on the AMD machine); 4) the suite's Llama 4 GiB
# row at the defaults; 5) with time left, the profile measured again (its CPU tables with prefetching).
# If 2) does not pay there, set PF_WORDS_DEFAULT to 0 in engine/kernels/cpu_linear.c (or keep it for CPUs
# where it was measured) before the row is kept; if it pays, part_replace --models llama3-8b --budgets 4GiB.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callcd; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-540} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "cpu_matmul, prefetch off/on"
timeout 120 python3 -m engine.bench.cpu_matmul --rows 1,4,8,16 --dtypes bfloat16 --prefetch 0,512,0,512 --out $W/cpu \
  > $W/cpu.log 2>&1; echo "rc=$?"; grep "rows\|FFN block\|host memory" $W/cpu.log | cut -c1-200
cp $W/cpu/cpu_matmul.json $OUT/ 2>/dev/null
timeout 60 python3 -m engine.bench.coded_matmul --rows 1,4 --prefetch 0,512 --out $W/coded > $W/coded.log 2>&1
echo "rc=$?"; grep "^|" $W/coded.log | tail -8
step "Llama-3-8B 4 GiB decode, prefetch off/on"
timeout 170 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --tokens 48 \
  --prefetch-variants 0,512 --order abba --out $W/decode > $W/decode.log 2>&1; echo "rc=$?"
grep "^|" $W/decode.log | cut -c1-40,100-200 | head -9; cp $W/decode/decode_runs.json $OUT/ 2>/dev/null
step "Llama-3-8B 4 GiB decode, the CPU reading coded weights, prefetch off/on"
SLIPSTREAM_CPU_CODED=1 timeout 150 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 4 \
  --tokens 48 --prefetch-variants 0,512 --order abba --out $W/decode-cpucoded > $W/decode-cpucoded.log 2>&1; echo "rc=$?"
grep "^|" $W/decode-cpucoded.log | cut -c1-40,100-200 | head -7
cp $W/decode-cpucoded/decode_runs.json $OUT/decode_runs-cpucoded.json 2>/dev/null
step "suite row, Llama 4 GiB (defaults)"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB --out $W/row --deadline-epoch $((D-5)) \
  > $W/row.log 2>&1; echo "rc=$?"; grep -h "slipstream llama3-8b\|opened" $W/row.log | cut -c1-200 | tail -3
cp $W/row/part-slipstream.json $OUT/part-slipstream-llama-4gib.json 2>/dev/null
left=$(( D - $(date +%s) ))
if [ $left -gt 75 ]; then
  step "profile with prefetching (50 s): the planner's CPU prices if it pays"
  timeout $(( left - 15 )) python3 -m engine profile --device cuda --db $W/h200-prefetch.json > $W/profile.log 2>&1
  echo "rc=$?"; cp $W/h200-prefetch.json $OUT/ 2>/dev/null
fi
step pack
tar cJf $OUT/callcd.tar.xz -C $W .
