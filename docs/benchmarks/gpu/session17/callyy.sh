#!/bin/bash
# Session 17, call YY (about 5 min): (1) the host's page and NUMA facts; (2) one Llama-3-8B layer's CPU attention
# and FFN calls phase by phase (engine.bench.cpu_call_phases) in four conditions: pageable or pinned weights
# (--pinned, as the executor keeps them), alone or beside pinned host -> GPU copies (--beside-copies), for the
# attention call that ran 1.8x slower beside a decode's copies (call SS) against 1.4x for the FFN call;
# (3) the suite's Llama rows with each row's rates probed before and after its engine (gpu_common.rates_probe),
# for the decode against the bound at the lease's own rates. Copy this and the profile (h200-profile.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
W=/tmp/callyy; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-560} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "host facts"
{ for f in enabled defrag; do echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>&1)"; done
  grep -i -E "huge|MemTotal|MemFree" /proc/meminfo; lscpu; ls /sys/devices/system/node/ 2>&1; } > $W/host.txt 2>&1
grep -E "thp|NUMA|Model name|Thread|Socket|L3" $W/host.txt
n=0
for f in "" "--pinned" "--beside-copies" "--pinned --beside-copies"; do
  n=$((n+1)); step "phases [$f]"
  timeout 60 python3 -m engine.bench.cpu_call_phases --shape llama3-8b --ctx 100 --reps 200 $f --out $W/phases$n 2>&1 \
    | grep -E "^\||cycled" | grep -v -- "---"
done
step "suite, Llama, with rate probes"
python3 -m engine bench --gpu --part slipstream --models llama3-8b --out $W/llama --deadline-epoch $((D-8)) 2>&1 | grep -v "^USDT" | tail -10
cp $W/llama/part-slipstream.json $OUT/part-slipstream-llama.json 2>/dev/null
step pack
tar cJf $OUT/callyy.tar.xz -C $W .
