#!/bin/bash
# Session 19, call K (about 8 min): plans balanced on the rates measured at open (TorchEngine._at_rates_now,
# new: the stored profile's CPU and PCIe rates moved to a two-second probe's), and one more Llama-3-8B 4 GiB
# pair with llama.cpp on one lease. (1) builds llama.cpp beside the GGUF; (2) llama.cpp-default and
# nommap+attn-gpu at 4 GiB, three llama-bench runs per figure; (3) in one engine, runs taking turns between
# the stored profile's plans and the same profile moved to the rates probed now (decode_runs --profiles
# P,lease:P); (4) the suite's Slipstream row at 4 GiB (the engine now probes at open by default).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callk; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-585} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "build llama.cpp beside the GGUF"
(python3 -m engine bench --gpu --part build-llamacpp --out $W/build > $W/build.log 2>&1 || tail -20 $W/build.log) &
python3 -m engine bench --gpu --part gguf --models llama3-8b --out $W/gguf > $W/gguf.log 2>&1; echo "gguf rc=$?"
wait; grep -h "llama.cpp:" $W/build.log | tail -2
step "llama.cpp rows, 4 GiB"
python3 -m engine bench --gpu --part llamacpp --models llama3-8b --budgets 4GiB --no-batched --tuned nommap+attn-gpu \
  --llamacpp-prompts 512 --llamacpp-reps 3 --out $W/llamacpp --deadline-epoch $((D-200)) > $W/llamacpp.log 2>&1
echo "rc=$?"; grep -v "^USDT" $W/llamacpp.log | tail -4
step "Llama 4 GiB decode: stored profile / moved to the rates now, in turns"
timeout $(( D - 75 - $(date +%s) )) python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 \
  --profiles $W/profile.json,lease:$W/profile.json --out $W/ab > $W/ab.log 2>&1; echo "rc=$?"
grep -v "^USDT" $W/ab.log | grep -E "^\| [0-9]|rates now|lease:|Error|error" | cut -c1-170 | tail -9
step "Slipstream row, 4 GiB"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 4GiB --out $W/slipstream \
  --deadline-epoch $((D-6)) > $W/slipstream.log 2>&1; echo "rc=$?"; grep -v "^USDT" $W/slipstream.log | tail -5
cp $W/llamacpp/part-llamacpp.json $OUT/part-llamacpp-4gib.json 2>/dev/null
cp $W/slipstream/part-slipstream.json $OUT/part-slipstream-4gib.json 2>/dev/null
step pack
tar cJf $OUT/callk.tar.xz -C $W --exclude "*.gguf" --exclude build .
