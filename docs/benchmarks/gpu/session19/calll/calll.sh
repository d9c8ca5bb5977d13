#!/bin/bash
# Session 19, call L (about 7 min): the engine now probes the CPU and PCIe rates at open on CUDA and plans
# from the profile moved to them. (1) the CUDA tests that check budgets, NVML peaks and tokens across plans
# with the probe on (and the probe's own test); (2) the MoE decode at 4 and 2 GiB, runs taking turns in one
# engine between the stored profile's plans and the moved profile's (decode_runs --profiles P,lease:P).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/calll; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider --tb=short tests/engine/test_profile_rates.py \
  tests/engine/test_vram_cap.py tests/engine/test_oom_retry.py tests/engine/test_executor.py tests/engine/test_fidelity.py \
  2>&1 | grep -v "^  *File\|^$" | tail -40 > $W/tests.txt; tail -8 $W/tests.txt
for b in 4GiB 2GiB; do
  step "MoE $b decode: stored profile / moved to the rates now, in turns"
  timeout 130 python3 -m engine.bench.decode_runs --shape qwen3-30b-a3b --budget $b --runs 6 \
    --profiles $W/profile.json,lease:$W/profile.json --out $W/moe-$b > $W/moe-$b.log 2>&1; echo "rc=$?"
  grep -v "^USDT" $W/moe-$b.log | grep -E "^\| [0-9]|rates now|lease:|Error|error" | cut -c1-170 | tail -9
done
step pack
tar cJf $OUT/calll.tar.xz -C $W .
