#!/bin/bash
# Session 29's next call, CK (written, not run; up to 9.5 min). Copy into carry/ with the profile (h200-profile.json).
# 1) The MoE rows at 2, 4 and 8 GiB at the defaults, with both of session 29's fixes (a coded copy's escapes
#    put in slices; a KV cut's or a budget change's re-plan that runs short backs off): calls CH, CI and CJ ran
#    them on leases with 4-15% CPU steal in the decode runs, and CI and CJ lost the 4 GiB row to the second bug.
#    The table's MoE rows are session 26's (2 GiB) and session 24's (4, 8 GiB); `part_replace` takes only rows whose decode runs
#    saw at most 2% steal on the mean (`--max-steal`), as the table's other rows.
# 2) The CPU matmul's prefetching at 2 and 8 GiB (Llama-3-8B), off and on in turns in one engine: call CG's rows
#    at the defaults came out 11% under session 26's (same plans, no steal; its lease's copies beside the CPU
#    probed 45.3-45.9 against 49.2-51.5 GB/s). At 2 GiB the decode streams 20 FFNs; prefetching may take memory bandwidth
#    from the copies there (call CD measured it at 4 GiB only: +15%).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callck; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "MoE rows, 2, 4 and 8 GiB"
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 2GiB,4GiB,8GiB --out $W/moe \
  --deadline-epoch $((D-270)) > $W/moe.log 2>&1; echo "rc=$?"
grep -h "lease probe\|rates \|slipstream qwen3\|Error" $W/moe.log | cut -c1-300 | tail -7
cp $W/moe/part-slipstream.json $OUT/part-slipstream-moe.json 2>/dev/null
for b in 2GiB 8GiB; do
  step "prefetch off/on, Llama-3-8B $b"
  timeout 125 python3 -m engine.bench.decode_runs --shape llama3-8b --budget $b --runs 4 --tokens 48 \
    --prefetch-variants 0,512 --order abba --out $W/prefetch-$b > $W/prefetch-$b.log 2>&1; echo "rc=$?"
  grep "^|" $W/prefetch-$b.log | cut -c1-40,100-200 | head -7
  cp $W/prefetch-$b/decode_runs.json $OUT/decode_runs-prefetch-$b.json 2>/dev/null
done
step pack
tar cJf $OUT/callck.tar.xz -C $W .
