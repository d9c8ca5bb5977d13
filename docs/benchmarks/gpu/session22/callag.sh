#!/bin/bash
# Session 22, call AG (about 6 min). 1) `host_path_ops` (new): the host time of each operation of a
# one-token graph run from the host (stage, copy in, replay, copy out, wait, hand back) and variants of the
# hand-back and the wait. 2) The MoE decode's host path with its graphs found by tag (new: no weights
# dictionary, no key per attention once a graph is known) against the tree before (carry/old: git archive of
# 3e9433d with today's moe_host_overhead), processes taking turns, 2 GiB, every attention resident
# (--n-ctx 4096). 3) The CUDA tests of the graphs and the MoE host path.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
W=/tmp/callag; mkdir -p $W
cp carry/h200-profile.json $W/profile.json; export SLIPSTREAM_PROFILE_DB=$W/profile.json
T0=$(date +%s); step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
step "host path ops"
PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m engine.bench.host_path_ops --out $W/ops > $W/ops.log 2>&1; echo "rc=$?"
tail -8 $W/ops.log
for i in 1 2; do
  for v in old new; do
    step "probe $v $i"
    if [ $v = old ]; then tree=$PWD/carry/old; else tree=$PWD; fi
    (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 110 python3 -m engine.bench.moe_host_overhead --layers 24 \
      --device cuda --plan planner --budget 2GiB --n-ctx 4096 --steps 32 --reps 20 --no-profile --tag $v$i \
      --out $W/probe > $W/probe-$v$i.log 2>&1); echo "rc=$?"
    grep -E "decode step|attention|graph|wait|run_host|MoE layer" $W/probe-$v$i.log | grep -v USDT | head -14
  done
done
step "CUDA tests"
SLIPSTREAM_TEST_DEVICE=cuda PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/engine/test_cuda_graphs.py tests/engine/test_moe_host_path.py tests/engine/test_executor.py \
  2>&1 | grep -v "^  *File\|^$" | tail -30 > $W/tests.txt; tail -8 $W/tests.txt
step pack
tar cJf $OUT/callag.tar.xz -C $W .
