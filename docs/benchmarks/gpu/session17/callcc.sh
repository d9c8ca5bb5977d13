#!/bin/bash
# Session 17, call CC (written, not run; about 4 min): Llama-3-8B at 4 GiB decode runs with call AA's profile
# (the CPU attention priced as the executor runs it), which segfaulted in calls AA and BB (a general protection
# fault in a worker of the native library while the main thread was in kernels.ffn_layer), now with the thread
# pool's job counter closed before a new job's fields change (cpu_linear.c run_pool). If that runs clean, the old
# and the new profile's plans take turns in one engine (decode_runs --profiles); if not, the new profile with
# the AMX tiles off (SLIPSTREAM_CPU_AMX=0), then the old profile. After any crash the faulting instruction is named
# from dmesg's offset into the library (addr2line, objdump). Copy this and call AA's profile
# (gpu/session17/callaa/x/profile.json, as h200-profile-new.json) into carry/.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site carry/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD PYTHONFAULTHANDLER=1 SLIPSTREAM_KERNEL_CACHE=/tmp/callcc/kernels \
  SLIPSTREAM_KERNEL_DEBUG=1     # (the library with line information: addr2line names the source line)
W=/tmp/callcc; mkdir -p $W
T0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - T0 )) s)"; }
where() {   # name the library's faulting instruction from the newest dmesg line about it
  line=$(dmesg 2>/dev/null | grep "cpu_linear-" | tail -1); [ -z "$line" ] && return
  echo "dmesg: $line"
  so=$(ls $W/kernels/cpu_linear-*.so | head -1); off=$(echo "$line" | sed -n 's/.*\.so\[\([0-9a-f]*\),.*/\1/p')
  [ -n "$off" ] && addr2line -f -i -e "$so" 0x$off && objdump -d --no-show-raw-insn --start-address=$((0x$off - 48)) \
    --stop-address=$((0x$off + 16)) "$so" | tail -16
}
run() {   # $1 label, $2 profile, then env assignments
  local label=$1 prof=$2; shift 2
  step "Llama 4 GiB decode runs, $label"
  env "$@" SLIPSTREAM_PROFILE_DB=$prof timeout 80 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB \
    --runs 5 --out $W/runs-$label > $W/$label.log 2>&1; rc=$?; echo "rc=$rc"
  grep -v "^USDT" $W/$label.log | tail -8
  [ $rc -ne 0 ] && where
}
run new-fix carry/h200-profile-new.json SLIPSTREAM_CPU_AMX=1
if [ $rc -eq 0 ]; then     # no crash: both profiles' plans in one engine, runs taking turns
  step "Llama 4 GiB decode runs, old and new profile in turns, one engine"
  timeout 200 python3 -m engine.bench.decode_runs --shape llama3-8b --budget 4GiB --runs 8 \
    --profiles carry/h200-profile.json,carry/h200-profile-new.json --out $W/runs-ab > $W/ab.log 2>&1; rc=$?; echo "rc=$rc"
  grep -v "^USDT" $W/ab.log | tail -11
  [ $rc -ne 0 ] && where
else
  run new-noamx carry/h200-profile-new.json SLIPSTREAM_CPU_AMX=0
  run old carry/h200-profile.json SLIPSTREAM_CPU_AMX=1
fi
step pack
tar cJf $OUT/callcc.tar.xz -C $W --exclude kernels .
