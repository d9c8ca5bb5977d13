#!/bin/bash
# Session 18, call I (written, not run; about 5 min): is the MoE decode's attention cheaper on the CPU? Session 16's
# trace of the Qwen3-30B-A3B 2 GiB decode (call SS) put each GPU-resident attention at 0.62 ms with the hidden
# state's two crossings (0.41 ms of it host time outside PyTorch's ops), 15 ms of a 37 ms token; the estimator
# prices it at 0.49 ms plus 0.07 of crossings and the CPU attention call at 0.59 ms, so the planner keeps
# attention on the GPU. By its bytes (38 MB a layer) the CPU call would take about 0.4 ms beside copies.
# (1) the CPU attention call of that shape, alone and beside copies (cpu_call_phases); (2) the decode at 2 and
# 4 GiB with the planner's plan and the same plan with every attention on the CPU, runs taking turns in one
# engine (decode_runs --cpu-variants). Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/calli; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
n=0
for f in "--pinned" "--pinned --beside-copies"; do
  n=$((n+1)); step "MoE-shape CPU calls [$f]"
  timeout 60 python3 -m engine.bench.cpu_call_phases --shape qwen3-30b-a3b --ctx 100 --reps 200 $f --out $W/phases$n \
    > $W/phases$n.log 2>&1; echo "rc=$?"; grep -E "^\| (attention call|q/k/v|output)" $W/phases$n.log
done
for b in 2GiB 4GiB; do
  step "MoE $b decode, planner's plan and every attention on the CPU, in turns"
  timeout 150 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget $b --runs 8 \
    --cpu-variants none,layers.*.attn --out $W/moe-$b > $W/moe-$b.log 2>&1; echo "rc=$?"
  grep -v "^USDT" $W/moe-$b.log | grep -E "^\| [0-9]|Error|error" | cut -c1-150 | tail -9
done
step pack
tar cJf $OUT/calli.tar.xz -C $W .
