#!/usr/bin/env bash
# Prints the machine kind a benchmark figure was measured on, for the scripts to print beside
# every figure (issue 40): "<vendor> family F model M (<ISA>)", ISA the widest of avx512+bf16+vnni,
# avx512, avx2+fma or none, from /proc/cpuinfo's flags. The GEMV kernels' own choice is
# bench_gemv's "isa" (kernels/cpu/gemv.h).
set -euo pipefail
info=/proc/cpuinfo
field() { grep -m1 "^$1[[:space:]]*:" "$info" | cut -d: -f2 | xargs; }
flags=" $(field flags) "
has() { [[ $flags == *" $1 "* ]]; }
if has avx512f && has avx512_bf16 && has avx512_vnni; then isa="avx512 bf16 vnni"
elif has avx512f; then isa=avx512
elif has avx2 && has fma; then isa="avx2 fma"
else isa=none; fi
vendor=$(field vendor_id)
case $vendor in AuthenticAMD) vendor=AMD ;; GenuineIntel) vendor=Intel ;; esac
echo "$vendor family $(field 'cpu family') model $(field model) ($isa)"
