#!/bin/bash
# Session 24, call BI (about 3.5 min): BH's MoE 2 GiB decode read 18.6 t/s against 33.8 in BC, with coded
# copies issued from their own thread (8 streamed attentions a token). The step's thread spun on GPU events
# holding the interpreter lock, so the issuer waited up to 5 ms to issue a copy. Now the spin yields the lock
# and the switch interval is 0.2 ms while an issuer runs. A/B: the issuer off/on in turns (abba) on the MoE
# shape at 2 GiB and Llama-3-8B at 4 GiB; before them the CUDA tests of transfer coding.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callbi; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_transfer_code.py > $W/tests.txt 2>&1
grep -v "^  *File\|^$" $W/tests.txt | tail -4
step "MoE 2 GiB decode, issuer off/on"
timeout 170 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget 2GiB --runs 6 --issuer-variants off,on \
  --order abba --out $W/moe > $W/moe.log 2>&1; echo "rc=$?"
grep "^| [0-9]" $W/moe.log | cut -d'|' -f2,8,10,12,13
step "Llama 4 GiB decode, issuer off/on"
timeout 130 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --issuer-variants off,on \
  --order abba --out $W/llama > $W/llama.log 2>&1; echo "rc=$?"
grep "^| [0-9]" $W/llama.log | cut -d'|' -f2,8,10,12,13
step pack
tar cJf $OUT/callbi.tar.xz -C $W .
