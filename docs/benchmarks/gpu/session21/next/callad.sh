#!/bin/bash
# Written in session 21 for the next session (not run; about 5 min). "A game always wins": VRAM back to the
# driver within a quarter second of a budget drop, now that the allocator runs with expandable segments by
# default (session 21, calls X and Y; `device.expandable_segments`). The issue-3 measurement (8 -> 2 GiB
# mid-generation, a 2 ms NVML poll; 78 ms to 90% of the drop with fixed segments) with expandable segments,
# then with them off (SLIPSTREAM_EXPANDABLE_SEGMENTS=0), one process each. Then: README's "Live
# re-planning" table and, if the drop is slower, the default.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callad; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
for mode in on off; do
  if [ $mode = off ]; then export SLIPSTREAM_EXPANDABLE_SEGMENTS=0; fi
  timeout 140 python3 -m engine.bench.replan_yield --shape llama3-8b --high 8GiB --low 2GiB --out $W/$mode \
    > $W/$mode.log 2>&1; echo "expandable $mode rc=$?"
  grep -v "^USDT" $W/$mode.log | tail -8
done
tar cJf $OUT/callad.tar.xz -C $W .
