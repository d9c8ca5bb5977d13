#!/bin/bash
# Session 12, call X: the AMX-tile expert jobs and the smaller head scratch on the H200 machine.
# CUDA tests of the touched paths; the H200 profile measured again (the fingerprint changes with the
# kernel's status line, and the CPU section gains the expert-job table); the CPU experts of prompt-sized
# steps with the tiles on and off; then the MoE suite rows under the new profile.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callx; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-520} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_PROFILE_DB=/tmp/test-profile.json SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_cpu_kernel.py tests/engine/test_moe_host_path.py tests/engine/test_executor.py tests/engine/test_planner_memory.py tests/engine/test_vram_cap.py 2>&1 | grep -v "^  *File\|^$" | tail -40 > $W/tests.txt; tail -6 $W/tests.txt
step profile
export SLIPSTREAM_PROFILE_DB=$W/h200-profile.json
timeout 150 python3 -m engine profile --device cuda 2>&1 | tail -30 > $W/profile.txt; grep -i "expert\|matmul now\|rror" $W/profile.txt | head; python3 -c "
import json; d = json.load(open('$W/h200-profile.json')); p = next(iter(d['profiles'].values())); print(p['cpu'].get('experts')); print(p['fingerprint']['cpu_matmul'])"
step experts
for amx in 1 0 1 0; do SLIPSTREAM_CPU_AMX=$amx timeout 60 python3 -m engine.bench.moe_cpu_experts --batches 32,64,256,512 --tokens 8 --out $W/experts-$amx 2>&1 | grep "batch" | sed "s/^/amx=$amx /" | tee -a $W/experts.txt | cut -c1-200; done
step suite
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -10
cp $W/suite/part-slipstream.json $W/h200-profile.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/callx.tar.xz -C $W .
