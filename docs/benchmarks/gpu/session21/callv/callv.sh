#!/bin/bash
# Written in session 20 for the next session (not run; about 8 min). (1) The suite's MoE rows again: the
# graphs' host path (OneTokenGraphs.run_host, session 20's call S: about 4 ms a token faster at 2 GiB) is on
# now, and the committed MoE rows are session 18's. (2) The CPU's matmuls at 1-512 rows, alone and beside
# host -> GPU copies, against the profile's price (session 20's call Q: the CPU's rows of split FFNs ran 3-8x
# below it). Then, here: part_replace --models qwen3-30b-a3b --archive session18 and the merge (HOWTO_GPU).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callv; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "CPU matmul rows, alone and beside copies"
for mode in "" "--beside-copies"; do
  timeout 70 python3 -m engine.bench.cpu_matmul --rows 1,4,16,64,256,512 --dtypes bfloat16 --engine-path $mode \
    --rotate-gib 1 --min-s 0.3 --profile-file $W/profile.json --out $W/cpu_matmul${mode:+-copies} 2>&1 | tail -9
done
step "the suite's MoE rows"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --out $W/slipstream \
  --deadline-epoch $((D-6)) > $W/slipstream.log 2>&1; echo "rc=$?"; grep -v "^USDT" $W/slipstream.log | tail -8
cp $W/slipstream/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
step pack
tar cJf $OUT/callv.tar.xz -C $W .
