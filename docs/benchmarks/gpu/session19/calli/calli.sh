#!/bin/bash
# Session 19, call I (about 7 min): where the MoE decode's time goes past the bound (0.34-0.40x).
# Session 16's trace of the Qwen3-30B-A3B 2 GiB decode put the CPU MoE layer call at 1.19 ms a layer (75 MB of
# routed experts: 63 GB/s against the lease probe's 110-128 GB/s one-token matmuls) and each GPU-resident
# attention with the hidden state's two crossings at 0.62 ms (15 ms of a 37 ms token).
# (1) the layer call alone, pinned weights rotated over 4 layers, with and without 600 us of busy host time
#     before each step (the pool's workers asleep, as after a GPU attention): moe_cpu_experts;
# (2) the CPU attention call of that shape (cpu_call_phases);
# (3) the decode at 2 and 4 GiB, runs taking turns in one engine between the planner's plan and every
#     attention on the CPU (decode_runs --cpu-variants), crossed with the pool's spin before sleeping
#     (2000 pauses, the default, about 0.1 ms; 20000, about 1 ms: --spins).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/calli; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
n=0
for g in 0 600; do
  n=$((n+1)); step "MoE layer call alone, gap $g us"
  timeout 90 python3 -m engine.bench.moe_cpu_experts --pinned --layers 4 --tokens 60 --batches 1,4 --gap-us $g \
    --out $W/experts$n > $W/experts$n.log 2>&1; echo "rc=$?"; grep -E "batch|Error" $W/experts$n.log | cut -c1-400
done
n=0
for f in "--pinned" "--pinned --beside-copies"; do
  n=$((n+1)); step "MoE-shape CPU calls [$f]"
  timeout 60 python3 -m engine.bench.cpu_call_phases --shape qwen3-30b-a3b --ctx 100 --reps 200 $f --out $W/phases$n \
    > $W/phases$n.log 2>&1; echo "rc=$?"; grep -E "^\| (attention call|q/k/v|output)" $W/phases$n.log
done
for b in 2GiB 4GiB; do
  step "MoE $b decode: planner's plan / every attention on the CPU, spin 2000 / 20000"
  timeout 170 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget $b --runs 8 \
    --cpu-variants none,layers.*.attn --spins 2000,20000 --out $W/moe-$b > $W/moe-$b.log 2>&1; echo "rc=$?"
  grep -v "^USDT" $W/moe-$b.log | grep -E "^\| [0-9]|Error|error" | cut -c1-160 | tail -9
done
step pack
tar cJf $OUT/calli.tar.xz -C $W .
