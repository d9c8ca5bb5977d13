#!/bin/bash
# Session 16, call TT (about 9.5 min): (1) decode beside a plan refinement on the MoE shape at 2 GiB, the
# refinement yielding (the default since this session) and not (engine.bench.refine_contention): the thread
# that prices a new KV capacity's plans holds the interpreter lock, and the suite's MoE 2 GiB decode runs
# were 18.8, 18.5 and 25.9 t/s where decode_steps measured 37.3 ms a token (26.8 t/s) on call SS's lease;
# (2) the suite's Slipstream rows of both shapes with session 15's changes (MoE layers whole in VRAM for
# small steps, the KV capacity cut back at a short request) and this one. Put the rows into gpu/issue6 with
# engine.bench.part_replace (--models qwen3-30b-a3b and --models llama3-8b), then merge. Copy this and the
# profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/calltt; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { local t=$(( D - $(date +%s) - ${1:-0} )); echo $(( t > 30 ? t : 30 )); }
step "refinement beside a MoE 2 GiB decode"
timeout 110 python3 -m engine.bench.refine_contention --shape qwen3-30b-a3b --budget 2GiB --tokens 48 --repeats 3 --out $W/refine 2>&1 | grep -v "^USDT" | tail -14
step "suite, MoE"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/moe --deadline-epoch $((D-200)) 2>&1 | grep -v "^USDT" | tail -8
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step "suite, Llama"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-8)) 2>&1 | grep -v "^USDT" | tail -8
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step pack
tar cJf $OUT/calltt.tar.xz -C $W .
