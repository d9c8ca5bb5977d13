#!/bin/bash
# Session 7, call C: llama.cpp's prefill of 4096 tokens on the Qwen3-30B-A3B shape (24 of 48 layers, F16) at
# 4 and 8 GiB: build llama.cpp beside the GGUF write, then default + tuned (--n-cpu-moe) with -p 4096.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
D=$(( $(date +%s) + ${BUDGET_S:-565} )); L=$OUT/callc.log
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $L
(python3 -m engine bench --gpu --part build-llamacpp --out /tmp/cc --prior carry/bench_moe > /tmp/build.log 2>&1 || tail -40 /tmp/build.log) &
python3 -m engine bench --gpu --part gguf --models qwen3-30b-a3b --out /tmp/cc 2>&1 | tail -3 | tee -a $L
wait; grep -h "llama.cpp:" /tmp/build.log | tail -2 | tee -a $L
python3 -m engine bench --gpu --part llamacpp --models qwen3-30b-a3b --budgets 4GiB,8GiB --llamacpp-prompts 4096 --no-batched --out /tmp/cc --prior carry/bench_moe --deadline-epoch $((D-10)) 2>&1 | tee -a $L
cp /tmp/cc/part-llamacpp.json /tmp/cc/llamacpp-logs.tar.xz $OUT/ 2>/dev/null; ls /tmp/cc
