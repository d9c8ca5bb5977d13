#!/bin/bash
# Written in session 21 for the next session (not run; about 5 min). "A game always wins": VRAM back to the
# driver within a quarter second of a budget drop, with the allocator's expandable segments
# (SLIPSTREAM_EXPANDABLE_SEGMENTS=1, off by default: session 21's calls X and Y showed they let a forced
# placement's switch through, and no call timed a drop with them). The issue-3 measurement (8 -> 2 GiB
# mid-generation, a 2 ms NVML poll; 78 ms to 90% of the drop with fixed segments) with them on, then off,
# one process each. Then: README's "Live re-planning" table, and the default if the drop stays well
# within a quarter second.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callad; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
for mode in on off; do
  if [ $mode = on ]; then export SLIPSTREAM_EXPANDABLE_SEGMENTS=1; else unset SLIPSTREAM_EXPANDABLE_SEGMENTS; fi
  timeout 140 python3 -m engine.bench.replan_yield --shape llama3-8b --high 8GiB --low 2GiB --out $W/$mode \
    > $W/$mode.log 2>&1; echo "expandable $mode rc=$?"
  grep -v "^USDT" $W/$mode.log | tail -8
done
tar cJf $OUT/callad.tar.xz -C $W .
