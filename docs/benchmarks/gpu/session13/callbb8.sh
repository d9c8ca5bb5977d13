#!/bin/bash
# Session 13, call BB8 (the 8 GiB rows calls BB and CC left; llama.cpp prompts of 512 only, for the device time left): the MoE llama.cpp rows again, on a GGUF whose tokens spread over the experts (the
# weights of earlier calls made every token route to the same few experts by the last layers; see
# engine/loading/random_init.py). Builds llama.cpp, writes the 31 GB Qwen3-30B-A3B GGUF (24 layers), then
# llama-bench -p 512,4096 at 2/4/8 GiB: llama.cpp-default and the tuned nommap+attn-gpu variant; batched
# runs with what is left. carry/bench/part-llamacpp.json: the dense rows, the allowance and the learned C
# (the MoE rows removed, so they run again).
D=$(( $(date +%s) + ${BUDGET_S:-570} )); L=$OUT/callbb8.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee $L
(python3 -m engine bench --gpu --part build-llamacpp --out $OUT --prior carry/bench > /tmp/build.log 2>&1 || tail -40 /tmp/build.log) &
python3 -m engine bench --gpu --part gguf --models qwen3-30b-a3b --out $OUT 2>&1 | tee -a $L
wait; grep -h "llama.cpp:" /tmp/build.log | tail -2 | tee -a $L
python3 -m engine bench --gpu --part llamacpp --models qwen3-30b-a3b --budgets 8GiB --tuned nommap+attn-gpu --llamacpp-prompts 512 --no-batched --out $OUT --prior carry/bench --deadline-epoch $((D-95)) 2>&1 | tee -a $L
# Then Slipstream's MoE 8 GiB row, which call CC left (the same weights as there).
cp carry/h200-profile.json /tmp/profile.json; export SLIPSTREAM_PROFILE_DB=/tmp/profile.json
python3 -m engine bench --gpu --part slipstream --models qwen3-30b-a3b --budgets 8GiB --out /tmp/suite8 --deadline-epoch $((D-3)) 2>&1 | grep -v "^ *\^" | grep "slipstream\|Error\|rror:" | tail -4 | tee -a $L
cp /tmp/suite8/part-slipstream.json $OUT/part-slipstream-moe8.json 2>/dev/null
