#!/bin/bash
# Session 22, call AH (about 4.5 min). The co-run scenario again with today's engine, where the allocator's
# expandable segments are on by default (new this session) beside the allocator cap (session 10) and the
# host path: the game stand-in and Slipstream in auto mode (as the app wires it, and less the engine's
# measured overhead). The game must never run out of memory.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
D=$(( $(date +%s) + 400 ))
python3 -m engine bench --gpu --part corun --corun-systems slipstream,slipstream+overhead --out $OUT/corun \
  --prior carry/bench --deadline-epoch $D > /tmp/corun.log 2>&1; echo "rc=$?"
grep -v "^USDT" /tmp/corun.log | tail -15; cp /tmp/corun.log $OUT/corun.log
