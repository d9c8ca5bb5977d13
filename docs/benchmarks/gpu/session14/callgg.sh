#!/bin/bash
# Session 14, call GG (about 8.5 min): the CUDA test fixed after session 13's call CC; accelerate's MoE rows on
# the weights whose routing spreads (carry/bench/part-accelerate.json: the Llama rows, the MoE rows removed so
# they run again); the MoE shape's 512- and 4096-token prompts at 2 GiB timed step by step and profiled
# (session 13's 4096-token prompt took 1.04 s against 0.58 predicted; the pinned state moves' cost).
# Copy this, gpu/session12/diag_prefill.py and docs/benchmarks/profiles/h200.json (as h200-profile.json)
# into carry/ first.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callgg; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-570} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step tests
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_moe_host_path.py > $W/tests.txt 2>&1; tail -3 $W/tests.txt
step accelerate
python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --out $OUT --prior carry/bench --deadline-epoch $((D-165)) 2>&1 | tee $W/accelerate.log | grep "accelerate\|rror\|deadline" | tail -8
step "diag moe"
timeout $(( D - $(date +%s) - 8 )) python3 carry/diag_prefill.py qwen3-30b-a3b 2GiB 24 512,4096 > $W/diag-moe.txt 2>&1; grep -A6 '^==' $W/diag-moe.txt | head -24
grep "packed_move\|_move)\|to_host\|to_device" $W/diag-moe.txt | head -8
step pack
tar cJf $OUT/callgg.tar.xz -C $W .
