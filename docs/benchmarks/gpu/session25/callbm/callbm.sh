#!/bin/bash
# Session 25, call BM: prefill_timeline at 4 GiB (the host tier now pins piece by piece and stops when a request starts;
# call BL: 30-42 ms pins at each request start), then session 23 call BD's one-lease pair at 4 GiB (about 8 min with BUDGET_S=490):
# 1.5x decode target against llama.cpp without a lease between them (pairs so far: 1.51x, calls F and G; 1.41x,
# call H). Builds llama.cpp beside the GGUF, runs llama.cpp-default and the nommap+attn-gpu variant with three
# llama-bench runs per figure (--llamacpp-reps 3; one run of 32 tokens moved 6.11 -> 6.94 between calls G and H),
# with no --prior (a prior part's rows count as done and nothing runs: call F), then the suite's Slipstream row.
# Afterwards: python -m engine.bench.same_lease --into docs/benchmarks/gpu/issue6/same-lease.json --slipstream
# .../part-slipstream-4gib.json --llamacpp .../part-llamacpp-4gib.json --call "session N call J", and the merge.
# Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbm; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
echo "=== prefill timeline, 4 GiB"
timeout 70 python3 -m engine.bench.prefill_timeline --shape llama3-8b --budgets 4GiB --runs 2 \
  --out $W/timeline > $W/timeline.log 2>&1; echo "rc=$?"
grep -v USDT $W/timeline.log | cut -c1-150 | head -40
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-490} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "build llama.cpp beside the GGUF"
(python3 -m engine bench --gpu --part build-llamacpp --out $W/build > $W/build.log 2>&1 || tail -20 $W/build.log) &
python3 -m engine bench --gpu --part gguf --models llama3-8b --out $W/gguf > $W/gguf.log 2>&1; echo "gguf rc=$?"
wait; grep -h "llama.cpp:" $W/build.log | tail -2
step "llama.cpp rows, 4 GiB"
python3 -m engine bench --gpu --part llamacpp --models llama3-8b --budgets 4GiB --no-batched --tuned nommap+attn-gpu \
  --llamacpp-prompts 512 --llamacpp-reps 3 --out $W/llamacpp --deadline-epoch $((D-110)) > $W/llamacpp.log 2>&1
echo "rc=$?"; grep -v "^USDT" $W/llamacpp.log | tail -6
step "Slipstream row, 4 GiB"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB --out $W/slipstream \
  --deadline-epoch $((D-6)) > $W/slipstream.log 2>&1; echo "rc=$?"; grep -v "^USDT" $W/slipstream.log | tail -5
cp $W/llamacpp/part-llamacpp.json $OUT/part-llamacpp-4gib.json 2>/dev/null
cp $W/slipstream/part-slipstream.json $OUT/part-slipstream-4gib.json 2>/dev/null
step pack
tar cJf $OUT/callbm.tar.xz -C $W --exclude "*.gguf" --exclude build .
