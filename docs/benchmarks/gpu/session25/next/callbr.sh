#!/bin/bash
# Session 25's next call, BR (written, not run; about 6 min). Coded copies now cross into the staging ring before
# the compute that frees their slot (`Accelerator.ring_ahead`, SLIPSTREAM_RING_AHEAD; written after session 25's
# last call): its CUDA test first, then the decode with it off and on, in turns inside one engine (abba), for
# the Llama-3-8B shape at 4 GiB (16 FFNs streamed a token between CPU sub-layers) and the MoE shape at 2 GiB.
# Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbr; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests of transfer coding"
SLIPSTREAM_TEST_DEVICE=cuda timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_transfer_code.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -6
step "Llama-3-8B 4 GiB, ring ahead off/on"
timeout 170 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --tokens 48 \
  --ring-ahead-variants off,on --order abba --out $W/llama > $W/llama.log 2>&1; echo "rc=$?"
grep "^|" $W/llama.log | cut -d"|" -f2,9,11,14,15 | head -9
step "Qwen3-30B-A3B 2 GiB, ring ahead off/on"
timeout 200 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 4 --tokens 48 \
  --ring-ahead-variants off,on --order abba --out $W/moe > $W/moe.log 2>&1; echo "rc=$?"
grep "^|" $W/moe.log | cut -d"|" -f2,9,11,14,15 | head -7
step pack
tar cJf $OUT/callbr.tar.xz -C $W .
