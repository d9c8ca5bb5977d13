#!/bin/bash
# Session 19, call N (written, not run; about 6 min): is the Llama-3-8B decode's split between the CPU and
# PCIe right? At 4 GiB the planner streams 14 FFNs and computes 14 on the CPU (the stored profile prices a CPU
# FFN beside copies at 85 GB/s); the leases' own probes read 87-135 GB/s for that rate, and in session 19's
# call K the plan with one more FFN on the CPU ran 93.3 against 96.6 ms a token (one engine, in turns), the
# suite's row planned with three more 89 ms. Here, in one engine with runs taking turns, the planner's plan
# beside the same plan with 1, 2 and 3 of its streamed FFNs computed on the CPU instead
# (decode_runs --cpu-variants none,streamed-ffn:N), at 4 and 8 GiB, with the lease's rates probed before.
# If more CPU FFNs win on most leases, the stored profile's CPU-beside-copies rate is the price to revisit.
# Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/calln; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
python3 -c "from engine.bench.gpu_common import rates_probe; print('rates', rates_probe())" | tee $W/rates-before.txt
for b in 4GiB 8GiB; do
  step "Llama $b decode: the planner's split, then 1-3 streamed FFNs on the CPU, in turns"
  timeout 230 python3 -m engine.bench.decode_runs --shape llama3-8b --budget $b --runs 8 \
    --cpu-variants none,streamed-ffn:1,streamed-ffn:2,streamed-ffn:3 --out $W/llama-$b > $W/llama-$b.log 2>&1
  echo "rc=$?"; grep -v "^USDT" $W/llama-$b.log | grep -E "^\| [0-9]|Error|error" | cut -c1-170 | tail -9
done
python3 -c "from engine.bench.gpu_common import rates_probe; print('rates', rates_probe())" | tee $W/rates-after.txt
step pack
tar cJf $OUT/calln.tar.xz -C $W .
