#!/bin/bash
# Next call after callm.sh (written in session 9, not run): accelerate on the MoE shape (never run; about
# half a token per second, so few tokens), then the H200 profile measured again (it now measures
# native_call_us, and bf16 CPU matmuls of more than 4 rows take PyTorch's AMX path).
# Before it: rm -rf carry/bench && mkdir -p carry/bench && cp docs/benchmarks/gpu/issue6/part-*.json carry/bench/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
D=$(( $(date +%s) + ${BUDGET_S:-560} ))
python3 -m engine bench --gpu --part accelerate --models qwen3-30b-a3b --out $OUT --prior carry/bench --deadline-epoch $((D - 150)) 2>&1 | tail -8 | tee $OUT/calln.log
python3 -m engine.bench.moe_cpu_experts --out $OUT 2>&1 | tail -2 | tee -a $OUT/calln.log   # (session 9's prefetch: 75 MB at 60 GB/s before)
SLIPSTREAM_PROFILE_DB=$OUT/h200-profile.json timeout $(( D - $(date +%s) )) python3 -m engine profile --device cuda 2>&1 | tail -6 | tee -a $OUT/calln.log
