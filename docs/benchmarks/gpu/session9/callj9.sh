#!/bin/bash
# Session 9 call J: the one-call MoE layer without copying its expert stacks (call I's reshaped the strided
# stacks: 100 MB copies per group, graphs over their reserve). CUDA tests; the MoE decode (8 layers, 8 GiB)
# with the one-call layer on against off, alternating processes; the MoE suite rows.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callj; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-420} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 80 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py tests/engine/test_moe_host_path.py 2>&1 | tail -3
for run in on1 off1 on2 off2; do
  step "moe 8GiB layer call $run"
  SLIPSTREAM_MOE_LAYER_CALL=$([ ${run:0:2} = on ] && echo 1 || echo 0) timeout 45 python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 8GiB --kinds auto --tokens 48 --out $W/moe-$run 2>&1 | grep "==\|Error\|resident/"
done
step "moe suite"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -6
python3 -c "
import json; d = json.load(open('$W/suite/part-slipstream.json'))
for r in d['rows']: print(r.get('model'), r.get('budget'), r.get('cuda_graphs'), *[round(r.get(k) or 0, 2) for k in ('prefill512_tps', 'prefill4096_tps', 'decode_tps', 'decode_batch16_tps')], r.get('peak_vram_bytes'))" 2>&1 | tail -4
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callj9.tar.xz -C $W .
