#!/bin/bash
# Session 9 call K: the MoE shape's llama.cpp rows at 2 GiB (never run): build llama.cpp beside the GGUF
# write, then llama.cpp-default and the tuned variants at 2 GiB (llama-bench -p 512 -n 32 -r 1).
# Before it: rm -rf carry/bench && mkdir -p carry/bench && cp docs/benchmarks/gpu/issue6/part-*.json carry/bench/
D=$(( $(date +%s) + ${BUDGET_S:-440} )); L=$OUT/callk9.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $L
(python3 -m engine bench --gpu --part build-llamacpp --out $OUT --prior carry/bench > /tmp/build.log 2>&1 || tail -40 /tmp/build.log) &
python3 -m engine bench --gpu --part gguf --models qwen3-30b-a3b --out $OUT 2>&1 | tee -a $L
wait; grep -h "llama.cpp:" /tmp/build.log | tail -2 | tee -a $L
python3 -m engine bench --gpu --part llamacpp --models qwen3-30b-a3b --budgets 2GiB --no-batched --out $OUT --prior carry/bench --deadline-epoch $((D-10)) 2>&1 | tee -a $L
ls $OUT
