#!/bin/bash
# Session 25, call BK (about 5 min). 1) Why the coded mid-generation placements test parts from the raw
# copies at its last token on CUDA (call BJ): debug_coded.py runs one schedule coded and raw, twice each,
# with CUDA graphs and the copy issuer on and off. 2) The CUDA tests of the out-of-memory paths and transfer
# coding. 3) The suite's MoE 2 GiB row, which met the allocator's cap growing a KV pool in call BJ (the pool
# now gives the cached blocks back and tries again; a growth that still fails backs off like a step).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbk; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-330} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "coded against raw, one schedule"
timeout 100 python3 carry/debug_coded.py llama3 > $W/debug.txt 2>&1; echo "rc=$?"; grep "seed\|Error" $W/debug.txt
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_oom_retry.py tests/engine/test_transfer_code.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -6
step "MoE 2 GiB row"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB --out $W/moe \
  --deadline-epoch $((D-5)) > $W/moe.log 2>&1; echo "rc=$?"; grep -h "slipstream qwen3\|opened\|Error" $W/moe.log | tail -4
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe-2gib.json 2>/dev/null
step pack
tar cJf $OUT/callbk.tar.xz -C $W .
