#!/bin/bash
# Next call (written in session 16, not run; about 6 min): the suite's Slipstream rows of both shapes with
# the one-step prompt kept on the decode plan (TorchEngine._staying_pays; call VV: no slow second token on
# the MoE shape at 4 GiB). Each row now keeps every decode run's token times, the host's stolen CPU share and
# its load (decode_runs_detail), for the runs that differ by a third inside the suite (call TT). Put the rows
# into gpu/issue6 with engine.bench.part_replace (--models qwen3-30b-a3b and --models llama3-8b), then merge.
# Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callxx; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "suite, MoE"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/moe --deadline-epoch $((D-200)) 2>&1 | grep -v "^USDT" | tail -8
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step "suite, Llama"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-8)) 2>&1 | grep -v "^USDT" | tail -8
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step pack
tar cJf $OUT/callxx.tar.xz -C $W .
