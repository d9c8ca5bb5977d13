#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD SLIPSTREAM_PROFILE_DB=/tmp/p.json
cp carry/h200-profile.json /tmp/p.json
timeout 80 python3 carry/diag_prefill.py llama3-8b 2GiB 0 4096 2>&1 | tee $OUT/diag-llama.txt | head -30
timeout 100 python3 carry/diag_prefill.py qwen3-30b-a3b 2GiB 24 512 2>&1 | tee $OUT/diag-moe.txt | head -30
