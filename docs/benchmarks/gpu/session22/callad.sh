#!/bin/bash
# Session 22, call AD (second try; the first stopped at the fresh 2 GiB engine: the first engine's allocator
# cap, process-wide, outlived its close, and the random weights made on the GPU did not fit under it. The
# accelerator now lifts its cap when it closes). "A game always wins": the issue-3 drop (8 -> 2 GiB
# mid-generation, a 2 ms NVML poll; 78 ms to 90% of the drop with fixed segments) with the allocator's
# expandable segments on (SLIPSTREAM_EXPANDABLE_SEGMENTS=1), then off, one process each. Then the CUDA
# tests of the cap and of expandable segments.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
W=/tmp/callad; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
for mode in on off; do
  if [ $mode = on ]; then export SLIPSTREAM_EXPANDABLE_SEGMENTS=1; else unset SLIPSTREAM_EXPANDABLE_SEGMENTS; fi
  timeout 150 python3 -m engine.bench.replan_yield --shape llama3-8b --high 8GiB --low 2GiB --out $W/$mode \
    > $W/$mode.log 2>&1; echo "expandable $mode rc=$?"
  grep -v "^USDT" $W/$mode.log | tail -8
done
unset SLIPSTREAM_EXPANDABLE_SEGMENTS
SLIPSTREAM_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_vram_cap.py tests/engine/test_expandable_segments.py 2>&1 | tail -15 > $W/tests.txt
tail -6 $W/tests.txt
tar cJf $OUT/callad.tar.xz -C $W .
