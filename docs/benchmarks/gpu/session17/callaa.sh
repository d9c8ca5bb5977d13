#!/bin/bash
# Session 17, call AA (about 6 min): the profile's CPU attention factor measured again on the H200 host, now as
# the executor runs a one-token CPU attention (one native call; before, the tensor path: 1.32 ms against the
# call's 0.57-0.77, so the planner priced the decode's CPU attention at about twice its cost and streamed more
# FFNs than the copy engine could carry). Then Llama-3-8B at 4 GiB, fresh engines set up as the suite's
# (engine.bench.decode_runs), with the old profile and the new one, and the suite's Llama rows with the new
# profile and each row's rates probed. Copy this and the profile (h200-profile.json) into carry/.
# Call ZZ ran this before the attention call set the library's thread pool to torch's count: the measurement's
# first native call was that one, so it ran on one thread (7.7 ms) and the factor came out at its clamp (3.0).
# Call AA runs it again with kernels.attention_decode syncing the pool.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callaa; mkdir -p $W
cp carry/h200-profile.json $W/old.json; cp carry/h200-profile.json $W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "attention factor, measured again"
timeout 60 python3 -m engine.sharding.measure --attn-block --update $W/profile.json 2>&1 | grep -v "^USDT" | tail -4
cp $W/profile.json $OUT/h200-profile-updated.json
step "Llama 4 GiB decode runs, old profile"
SLIPSTREAM_PROFILE_DB=$W/old.json timeout 120 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --out $W/runs-old 2>&1 | grep -v "^USDT" | tail -9
step "Llama 4 GiB decode runs, new profile"
SLIPSTREAM_PROFILE_DB=$W/profile.json timeout 120 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 6 --out $W/runs-new 2>&1 | grep -v "^USDT" | tail -9
step "suite, Llama, new profile"
export SLIPSTREAM_PROFILE_DB=$W/profile.json
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-8)) 2>&1 | grep -v "^USDT" | tail -10
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step pack
tar cJf $OUT/callaa.tar.xz -C $W --exclude old.json .
