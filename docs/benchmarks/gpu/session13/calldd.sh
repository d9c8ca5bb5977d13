#!/bin/bash
# The next call (written in session 13, not run; about 10 min): the llama.cpp MoE rows session 13 left, on
# the GGUF whose tokens spread over the experts. Builds llama.cpp (about 300 s) beside the GGUF (31 GB, about
# 50 s), then llama-bench -p 512,4096 at 8 GiB (llama.cpp-default and nommap+attn-gpu), then
# llama-batched-bench at 2, 4 and 8 GiB (batches of 4 and 16), resuming from carry/bench/part-llamacpp.json
# (copy gpu/issue6/part-llamacpp.json there first: its 2 and 4 GiB MoE rows are done; a cut call resumes).
D=$(( $(date +%s) + ${BUDGET_S:-570} )); L=$OUT/calldd.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $L
(python3 -m engine bench --gpu --part build-llamacpp --out $OUT --prior carry/bench > /tmp/build.log 2>&1 || tail -40 /tmp/build.log) &
python3 -m engine bench --gpu --part gguf --models qwen3-30b-a3b --out $OUT 2>&1 | tee -a $L
wait; grep -h "llama.cpp:" /tmp/build.log | tail -2 | tee -a $L
python3 -m engine bench --gpu --part llamacpp --models qwen3-30b-a3b --budgets 2GiB,4GiB,8GiB --tuned nommap+attn-gpu --llamacpp-prompts 512,4096 --out $OUT --prior carry/bench --deadline-epoch $((D-10)) 2>&1 | tee -a $L
