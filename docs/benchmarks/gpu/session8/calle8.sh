#!/bin/bash
# Next call (written in session 8, not run): CUDA graphs on (SLIPSTREAM_CUDA_GRAPHS=1), their memory given back at every re-plan. CUDA graph tests, then the
# suite's Llama-3-8B rows at 2 and 4 GiB (call D met an out-of-memory when 4 GiB's weights came in).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json PYTHONPATH=/tmp/site:$PWD SLIPSTREAM_CUDA_GRAPHS=1
cp docs/benchmarks/profiles/h200.json /tmp/profile.json
W=/tmp/calle; mkdir -p $W
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-150} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 40 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py 2>&1 | tail -3
step suite
timeout $(( D - $(date +%s) )) python3 -m engine bench --gpu --part slipstream --models llama3-8b --budgets 2GiB,4GiB --runs 1 --out $W/suite 2>&1 | grep -v "^ *\^" | tail -8
python3 -c "
import json; d = json.load(open('$W/suite/part-slipstream.json'))
for r in d['rows']: print(r['budget'], r.get('cuda_graphs'), r.get('prefill4096_tps'), r.get('decode_tps'), r.get('peak_vram_bytes'))" 2>&1 | tail -3
step pack
cp $W/suite/part-slipstream.json $OUT/ 2>/dev/null; tar cJf $OUT/calle8.tar.xz -C $W .
