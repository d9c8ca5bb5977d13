#!/bin/bash
# Next call (written in session 8, not run): the estimator's per-op and per-native-call host costs on the
# GPU. SmolLM2-135M's plans and their predictions against what they measure; Llama-3-8B at 8 GiB, where the
# new costs keep every layer's attention in VRAM, against the plan of the costs before (carry/old), in
# alternating processes. Before it: rm -rf carry/old && mkdir -p carry/old && git archive abc84b1 engine
# docs/benchmarks/profiles | tar -x -C carry/old; cp docs/benchmarks/gpu/session8/callf8.sh carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 SLIPSTREAM_PROFILE_DB=/tmp/profile.json
W=/tmp/callf; mkdir -p $W; R=$PWD
T0=$(date +%s); D=$(( T0 + ${BUDGET_S:-540} ))
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
left() { echo $(( D - $(date +%s) )); }
go() {   # go new|old label command...: each side plans with its own copy of the stored profile
  local which=$1; shift; local label=$1; shift
  if [ $which = old ]; then cd $R/carry/old; export PYTHONPATH=/tmp/site:$R/carry/old; else cd $R; export PYTHONPATH=/tmp/site:$R; fi
  cp docs/benchmarks/profiles/h200.json /tmp/profile.json
  step "$label"
  timeout $(( $(left) < 110 ? $(left) : 110 )) "$@" 2>&1 | grep "==\|opened\|Error\|median"
  cd $R
}
go new "smollm2" python3 -m engine.bench.host_costs --device cuda --shape smollm2-135m --budget 60GiB --kinds auto,gpu_only,static --tokens 48 --out $W/smollm2
for run in new1 old1 new2 old2; do
  go ${run:0:3} "llama 8GiB $run" python3 -m engine.bench.decode_steps --budgets 8GiB --tokens 48 --no-decode-traces --out $W/llama8-$run
done
go new "moe" python3 -m engine.bench.host_costs --device cuda --shape qwen3-30b-a3b --layers 8 --budget 4GiB --kinds auto --tokens 48 --out $W/moe
step pack
tar cJf $OUT/callf8.tar.xz -C $W .
