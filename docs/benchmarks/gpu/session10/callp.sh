#!/bin/bash
# Call P (session 10): the captured one-token attention after its fix (each padded context keeps its
# buffers and graphs; the eager one-token path takes the same kernel), its CUDA tests, then MoE decode
# (8 layers, 4 GiB) with it on against off, alternating processes, three times; accelerate's missing MoE
# row at 8 GiB; Llama-3-8B decode at 8 GiB on against off while time remains.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=$OUT/p; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-470} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_cuda_graphs.py tests/engine/test_host_kv.py tests/engine/test_moe_host_path.py tests/engine/test_executor.py 2>&1 | grep -v "^  *File\|^$" | tail -25 > $W/tests.txt; tail -12 $W/tests.txt
ON=$(grep -q " failed\|rror" $W/tests.txt && echo 0 || echo 1)
for run in on1 off1 on2 off2 on3 off3; do
  step "moe 4GiB captured attention $run"
  SLIPSTREAM_GRAPH_ATTENTION=$([ ${run:0:2} = on ] && echo $ON || echo 0) timeout 45 python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 4GiB --kinds auto --tokens 48 --out $W/moe-$run 2>&1 | grep "==\|Error\|resident/attn\|graph"
done
step "accelerate 8GiB"
python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --out $OUT --prior carry/bench --deadline-epoch $(( D - 60 )) 2>&1 | tail -4
for run in on1 off1 on2 off2; do
  [ $(( $(date +%s) + 50 )) -gt $D ] && break
  step "llama 8GiB captured attention $run"
  SLIPSTREAM_GRAPH_ATTENTION=$([ ${run:0:2} = on ] && echo $ON || echo 0) timeout 60 python3 -m engine.bench.decode_steps --budgets 8GiB --tokens 48 --no-decode-traces --out $W/llama8-$run 2>&1 | grep "==\|Error\|median"
done
step pack
tar cJf $OUT/callp.tar.xz -C $W .
