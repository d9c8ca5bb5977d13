#!/bin/bash
# Session 28 call CF (call CE again in a new lease, two rounds, llama.cpp unpacked from the parts CE packed into carry/, then the 4 GiB decode planned from the
# profile measured with prefetching in call CD (carry/h200-prefetch.json) against the shipped one, abba; about 8 min): one-lease pairs at 4 GiB taken in turns, llama.cpp,
# Slipstream, llama.cpp, Slipstream, so a lease that drifts during the call (call BM: its CPU probe fell from 121
# to 91 GB/s under Slipstream's row, which ran after llama.cpp's) weighs on both systems alike. Builds llama.cpp
# beside the GGUF, then two rounds of llama.cpp-default and the nommap+attn-gpu variant (two llama-bench runs per
# figure) and the suite's Slipstream row. Afterwards, for k in 1 2: python -m engine.bench.same_lease --into
# docs/benchmarks/gpu/issue6/same-lease.json --slipstream .../part-slipstream-4gib-$k.json --llamacpp
# .../part-llamacpp-4gib-$k.json --call "session N call BP, round k of 2 (taken in turns ...)", and the merge.
# Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callcf; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-570} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "build llama.cpp beside the GGUF"
(python3 -m engine bench --gpu --part build-llamacpp --out $W/build > $W/build.log 2>&1 || tail -20 $W/build.log) &
python3 -m engine bench --gpu --part gguf --models llama3-8b --out $W/gguf > $W/gguf.log 2>&1; echo "gguf rc=$?"
wait; grep -h "llama.cpp:" $W/build.log | tail -2
for k in 1 2; do
  step "round $k: llama.cpp rows, 4 GiB"
  python3 -m engine bench --gpu --part llamacpp --models llama3-8b --budgets 4GiB --no-batched --tuned nommap+attn-gpu \
    --llamacpp-prompts 512 --llamacpp-reps 2 --out $W/llamacpp-$k --deadline-epoch $((D-60)) > $W/llamacpp-$k.log 2>&1
  echo "rc=$?"; grep -v "^USDT" $W/llamacpp-$k.log | grep "llama.cpp-\|probe" | tail -3
  step "round $k: Slipstream row, 4 GiB"
  python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB --out $W/slipstream-$k \
    --deadline-epoch $((D-6)) > $W/slipstream-$k.log 2>&1; echo "rc=$?"; grep -v "^USDT" $W/slipstream-$k.log | grep "slipstream\|rates" | tail -3
  cp $W/llamacpp-$k/part-llamacpp.json $OUT/part-llamacpp-4gib-$k.json 2>/dev/null
  cp $W/slipstream-$k/part-slipstream.json $OUT/part-slipstream-4gib-$k.json 2>/dev/null
done
left=$(( D - $(date +%s) ))
if [ $left -gt 70 ]; then
  step "Llama-3-8B 4 GiB decode: the shipped profile against CD's, abba"
  timeout $(( left - 10 )) python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 4 --tokens 48 \
    --profiles carry/h200-profile.json,carry/h200-prefetch.json --order abba --out $W/profiles > $W/profiles.log 2>&1; echo "rc=$?"
  grep "^|" $W/profiles.log | cut -c1-40,100-200 | head -7; cp $W/profiles/decode_runs.json $OUT/decode_runs-profiles.json 2>/dev/null
fi
step pack
tar cJf $OUT/callcf.tar.xz -C $W --exclude "*.gguf" --exclude build .
