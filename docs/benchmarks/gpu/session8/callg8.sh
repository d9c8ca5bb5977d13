#!/bin/bash
# Next call (written in session 8, not run; after calle8.sh passed): the suite's Slipstream rows, both
# shapes, with CUDA graphs on, and graphs on against off for the MoE decode in alternating processes.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/callg; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
for run in on1 off1 on2 off2; do
  step "moe $run"
  SLIPSTREAM_CUDA_GRAPHS=$([ ${run:0:2} = on ] && echo 1 || echo 0) timeout 45 python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 4GiB --kinds auto --tokens 48 --out $W/moe-$run 2>&1 | grep "==\|Error\|resident/attn"
done
step suite
SLIPSTREAM_CUDA_GRAPHS=1 python3 -m engine bench --gpu --part slipstream --models llama3-8b,qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | tail -12
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callg8.tar.xz -C $W .
