#!/bin/bash
# Session 27, call CA (about 1.5 min): why the tight transfer code slowed the decode (call BY): a Llama-3-8B FFN's
# 336 MiB delivered into VRAM plain, 4-bit coded and tight coded, and the GPU decode's rate alone.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1
for t in "" --tight; do
  echo "=== transfer_code_rate $t ($(date +%T))"
  timeout 70 python3 -m engine.bench.transfer_code_rate --mib 336 --reps 10 $t --out $OUT/rate${t:+-tight} 2>&1 | grep -v "^USDT" | tail -12
done
