#!/bin/bash
# Next call (written in session 14, not run; about 10 min): llama.cpp's batched MoE rows at 4 and 8 GiB, which
# session 14's call DD left (its deadline came after the 2 GiB ones). Copy gpu/issue6/part-llamacpp.json into
# carry/bench/ first: every other MoE row is done there, so the call builds llama.cpp (about 335 s), writes the
# GGUF (about 60 s) beside it and runs only llama-batched-bench at 4 and 8 GiB.
D=$(( $(date +%s) + ${BUDGET_S:-570} )); L=$OUT/callll.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $L
(python3 -m engine bench --gpu --part build-llamacpp --out $OUT --prior carry/bench > /tmp/build.log 2>&1 || tail -40 /tmp/build.log) &
python3 -m engine bench --gpu --part gguf --models qwen3-30b-a3b --out $OUT 2>&1 | tee -a $L
wait; grep -h "llama.cpp:" /tmp/build.log | tail -2 | tee -a $L
python3 -m engine bench --gpu --part llamacpp --models qwen3-30b-a3b --budgets 4GiB,8GiB --tuned nommap+attn-gpu --llamacpp-prompts 512,4096 --out $OUT --prior carry/bench --deadline-epoch $((D-10)) 2>&1 | tee -a $L
