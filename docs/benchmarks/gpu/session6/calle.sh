#!/bin/bash
# Session 6, call E: CUDA tests (graphs), graphs on/off decode A/B at 4 GiB, suite Llama rows.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/calle; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-400} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py tests/engine/test_executor.py tests/engine/test_cpu_attention.py -k "graph or placement or host_kv or sim_plans" 2>&1 | tail -8
RC=${PIPESTATUS[0]}
G=1; if [ "$RC" != "0" ]; then G=0; echo "graph tests failed: the suite runs without graphs"; fi
step "decode graphs on"
SLIPSTREAM_CUDA_GRAPHS=$G timeout 110 python3 -m engine.bench.decode_steps --budgets 4GiB --tokens 32 --late-token 20 --out $W/graphs 2>&1 | grep -v "^ " | grep -v "^|---" | grep "==\|streamed/ffn\|resident/ffn\|cpu/attn\|cpu/ffn\|resident/attn\|Over"
step "decode graphs off"
SLIPSTREAM_CUDA_GRAPHS=0 timeout 90 python3 -m engine.bench.decode_steps --budgets 4GiB --tokens 32 --no-decode-traces --out $W/eager 2>&1 | grep "=="
step suite
SLIPSTREAM_CUDA_GRAPHS=$G python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/suite --deadline-epoch $D 2>&1 | tail -6
step pack
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null
tar cJf $OUT/calle.tar.xz -C $W .
