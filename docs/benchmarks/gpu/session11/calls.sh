#!/bin/bash
# Session 11, call S: the batch's CPU experts in bulk (moe._experts_batch) against the per-expert path,
# alternating processes; where a batched step's time goes (carry/diag_batch.py: Llama-3-8B 2 GiB at 16
# streams, the MoE shape 4 GiB at 4 and 16); then the MoE suite rows with the bulk path.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/calls; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-545} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_moe_host_path.py 2>&1 | tail -15 > $W/tests.txt; tail -3 $W/tests.txt
step experts
for run in 1 0 1 0; do
  SLIPSTREAM_MOE_CPU_BULK=$run timeout 60 python3 -m engine.bench.moe_cpu_experts --batches 4,16 --tokens 40 --out $W/experts-bulk$run 2>&1 | grep "batch\|rror" | sed "s/^/bulk=$run /"
done
step "diag llama"
timeout 100 python3 carry/diag_batch.py llama3-8b 2GiB 0 16 2>&1 | tee $W/diag-llama.txt | head -32
step "diag moe"
timeout 130 python3 carry/diag_batch.py qwen3-30b-a3b 4GiB 24 4,16 2>&1 | tee $W/diag-moe.txt | grep -v "^ *[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* {" | head -40
grep "^ *[0-9/]* *[0-9.]* " $W/diag-moe.txt | head -24
step "moe suite"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/suite --deadline-epoch $D 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -6
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
step pack
tar cJf $OUT/calls.tar.xz -C $W .
