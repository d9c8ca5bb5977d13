#!/bin/bash
# Session 9 call H: CUDA graphs on (SLIPSTREAM_CUDA_GRAPHS=1) with their memory given back at every re-plan.
# The CUDA graph tests; the suite's Llama-3-8B rows (2 -> 4 -> 8 GiB re-plans: session 8 call D met an
# out-of-memory at 2 -> 4 GiB); the MoE decode graphs on against off in alternating processes (8 layers,
# 4 GiB); the MoE suite rows with graphs on.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callh; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-550} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
step tests
SLIPSTREAM_CUDA_GRAPHS=1 SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py 2>&1 | tail -3
step "llama suite, graphs on"
SLIPSTREAM_CUDA_GRAPHS=1 timeout 150 python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | tail -6
for run in on1 off1 on2 off2; do
  step "moe $run"
  SLIPSTREAM_CUDA_GRAPHS=$([ ${run:0:2} = on ] && echo 1 || echo 0) timeout 50 python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 4GiB --kinds auto --tokens 48 --out $W/moe-$run 2>&1 | grep "==\|Error\|resident/attn"
done
step "moe suite, graphs on"
SLIPSTREAM_CUDA_GRAPHS=1 python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | tail -8
python3 -c "
import json; d = json.load(open('$W/suite/part-slipstream.json'))
for r in d['rows']: print(r.get('model'), r.get('budget'), r.get('cuda_graphs'), *[round(r.get(k) or 0, 2) for k in ('prefill512_tps', 'prefill4096_tps', 'decode_tps', 'decode_batch16_tps')], r.get('peak_vram_bytes'))" 2>&1 | tail -12
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callh9.tar.xz -C $W .
