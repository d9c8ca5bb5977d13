#!/bin/bash
# Session 27's next call, CC (written, not run; about 4.5 min). Copy into carry/ with the profile (h200-profile.json).
# The tight transfer code's decode loss (call BY: 9.35 against 9.79 t/s, Llama-3-8B 4 GiB) split between its
# code and its plan. The tight code's smaller streams moved the one-token plan (attentions 0-3 resident -> CPU,
# FFN 5 CPU -> resident, eight FFNs swapping stream/CPU; priced 95.7 against 96.9 ms). A 2x2 in one lease:
# each code in its own process (the code is fixed when the weights are packed), each taking turns (abba)
# between its own plan and the other code's plan, placed with `decode_runs --cpu-variants` PATTERN=PLACE
# entries and the 4-bit plan's KV prefix (kv_layers=4). The placements were read off the planner on the H200
# profile at the engine's bookable 3.08 GiB (session 27: `one_slot_plans.coded_like` at 0.7529 / 0.7194
# reproduces the engine's 96.94 / 95.7 ms; with the tight code the 4-bit plan is priced 96.28 ms).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callcc; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
FOUR_BIT_PLAN="layers.0.attn=resident+layers.1.attn=resident+layers.2.attn=resident+layers.3.attn=resident+layers.5.ffn=cpu+layers.6.ffn=streamed+layers.7.ffn=cpu+layers.8.ffn=streamed+layers.9.ffn=cpu+layers.11.ffn=streamed+layers.12.ffn=cpu+layers.13.ffn=streamed+layers.14.ffn=cpu+layers.16.ffn=streamed+layers.17.ffn=cpu+layers.21.ffn=streamed+layers.22.ffn=cpu+layers.26.ffn=streamed+layers.27.ffn=cpu+kv_layers=4"
TIGHT_PLAN="layers.0.attn=cpu+layers.1.attn=cpu+layers.2.attn=cpu+layers.3.attn=cpu+layers.5.ffn=resident+layers.6.ffn=cpu+layers.7.ffn=streamed+layers.8.ffn=cpu+layers.9.ffn=streamed+layers.11.ffn=cpu+layers.12.ffn=streamed+layers.13.ffn=cpu+layers.14.ffn=streamed+layers.16.ffn=cpu+layers.17.ffn=streamed+layers.21.ffn=cpu+layers.22.ffn=streamed+layers.26.ffn=cpu+layers.27.ffn=streamed"
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
for t in 1 0; do
  if [ $t = 1 ]; then other=$FOUR_BIT_PLAN; else other=$TIGHT_PLAN; fi
  step "tight=$t: its plan against the other code's plan"
  SLIPSTREAM_TRANSFER_CODE_TIGHT=$t timeout 150 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB \
    --runs 6 --tokens 48 --cpu-variants "none,$other" --order abba --out $W/tight$t > $W/tight$t.log 2>&1; echo "rc=$?"
  grep "^|" $W/tight$t.log | cut -c1-60,120-260 | head -9
  cp $W/tight$t/decode_runs.json $OUT/decode-runs-tight$t.json 2>/dev/null
done
step pack
tar cJf $OUT/callcc.tar.xz -C $W .
