#!/bin/bash
# Session 18, call F (about 9 min): llama.cpp and Slipstream on one lease, Llama-3-8B at 4 GiB, for the decode
# target against llama.cpp without a lease between them (the suite's llama.cpp rows are from earlier sessions'
# leases, and leases of this kind have differed by up to 1.5x in CPU rate). Builds llama.cpp (CUDA) beside the
# GGUF, then llama.cpp-default and the nommap+attn-gpu variant (-p 512, tg32), then the suite's Slipstream row at
# 4 GiB with its rate probes. Copy this, the profile (h200-profile.json) and carry/bench into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callf; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-585} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "build llama.cpp beside the GGUF"
(python3 -m engine bench --gpu --part build-llamacpp --out $W/build --prior carry/bench > $W/build.log 2>&1 || tail -20 $W/build.log) &
python3 -m engine bench --gpu --part gguf --models llama3-8b --out $W/gguf > $W/gguf.log 2>&1; echo "gguf rc=$?"
wait; grep -h "llama.cpp:" $W/build.log | tail -2
step "llama.cpp rows, 4 GiB"
python3 -m engine bench --gpu --part llamacpp --models llama3-8b --budgets 4GiB --no-batched --tuned nommap+attn-gpu \
  --llamacpp-prompts 512 --out $W/llamacpp --prior carry/bench --deadline-epoch $((D-120)) > $W/llamacpp.log 2>&1
echo "rc=$?"; grep -v "^USDT" $W/llamacpp.log | tail -8
step "Slipstream row, 4 GiB"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB --out $W/slipstream \
  --deadline-epoch $((D-6)) > $W/slipstream.log 2>&1; echo "rc=$?"; grep -v "^USDT" $W/slipstream.log | tail -6
cp $W/llamacpp/part-llamacpp.json $OUT/part-llamacpp-4gib.json 2>/dev/null
cp $W/slipstream/part-slipstream.json $OUT/part-slipstream-4gib.json 2>/dev/null
step pack
tar cJf $OUT/callf.tar.xz -C $W --exclude "*.gguf" --exclude build .
