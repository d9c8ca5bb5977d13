#!/bin/bash
# A call for the MoE decode gap (written in session 13, not run; about 6 min): 0.83-0.84x llama.cpp-tuned at
# 2 / 4 GiB. Where a decode step's host time goes, by component, with 24 layers under the static plan
# (attention and routers resident, every expert group on the CPU), at the two budgets' bookable room, then
# the same with the whole step profiled. Copy this and docs/benchmarks/profiles/h200.json (as
# h200-profile.json) into carry/ first.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
cp carry/h200-profile.json /tmp/profile.json; export SLIPSTREAM_PROFILE_DB=/tmp/profile.json
for b in 2GiB 4GiB; do
  timeout 240 python3 -m engine.bench.moe_host_overhead --layers 24 --device cuda --budget $b --steps 24 --tag cuda-24l-$b --out $OUT 2>&1 | tail -30
done
