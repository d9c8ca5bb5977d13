#!/bin/bash
# Next call (written in session 9, not run): the one-token attention captured whole
# (SLIPSTREAM_GRAPH_ATTENTION=1) and the bf16 native-matmul row limit on AMX hosts, on the GPU machine.
# CUDA tests; MoE decode (8 layers, 4 GiB) and Llama-3-8B decode at 8 GiB with the captured attention on
# against off, alternating processes; both shapes' suite rows (the batched rows' new count) with it on
# where the tests passed.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callm; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py tests/engine/test_host_kv.py tests/engine/test_moe_host_path.py tests/engine/test_executor.py 2>&1 | tail -4 | tee $W/tests.txt
ON=$(grep -q " failed" $W/tests.txt && echo 0 || echo 1)
for run in on1 off1 on2 off2; do
  step "moe 4GiB captured attention $run"
  SLIPSTREAM_GRAPH_ATTENTION=$([ ${run:0:2} = on ] && echo $ON || echo 0) timeout 45 python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 4GiB --kinds auto --tokens 48 --out $W/moe-$run 2>&1 | grep "==\|Error\|resident/attn"
done
for run in on1 off1; do
  step "llama 8GiB captured attention $run"
  SLIPSTREAM_GRAPH_ATTENTION=$([ ${run:0:2} = on ] && echo $ON || echo 0) timeout 70 python3 -m engine.bench.decode_steps --budgets 8GiB --tokens 48 --no-decode-traces --out $W/llama8-$run 2>&1 | grep "==\|opened\|Error\|median"
done
step "suite (SLIPSTREAM_GRAPH_ATTENTION=$ON)"
SLIPSTREAM_GRAPH_ATTENTION=$ON python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -8
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callm.tar.xz -C $W .
