#!/usr/bin/env bash
# The build's layering (CMakeLists.txt, docs/architecture.md), proved with the tools that
# enforce it: each layer compiles against an include root holding only itself and the layers
# it uses, its includes may not climb out with "..", an absolute path or a macro
# (scripts/check_includes.sh, run by the build), and it links with only the layers it uses.
# Checks that a lower layer's header is visible from a higher one and an upward include fails
# to compile; that the include rule refuses the escapes the compiler would accept; and that an
# upward call fails to link where a downward one links, for a layer and for the commands that
# only read a checkpoint (eval, generate, serve, inspect: no train/ in their link).
# Usage: check_layers.sh CXX BUILD_DIR SOURCE_DIR CMAKE
set -euo pipefail
cxx=$1 build=$2 src=$3 cmake=$4 layers=$2/layers
fail=0 checks=0
compiles() {  # compiles LAYER HEADER: 0 when HEADER is reachable from LAYER's include root
  echo "#include \"$2\"" | "$cxx" -std=c++20 -fsyntax-only -I "$layers/$1" -x c++ - 2>/dev/null
}
expect() {  # expect yes|no LAYER HEADER
  checks=$((checks + 1))
  if compiles "$2" "$3"; then got=yes; else got=no; fi
  if [[ $got != "$1" ]]; then echo "layer $2 including $3: expected $1, got $got"; fail=1; fi
}
expect yes model core/tensor.h
expect yes model kernels/cpu/gemm.h
expect no  model train/trainer.h
expect no  model optim/grad_norm.h
expect no  model ecss/expert_store.h
expect no  kernels model/model.h
expect no  core io/file.h
expect no  io train/checkpoint.h
expect yes ecss io/checkpoint_dir.h
expect no  ecss train/checkpoint.h
expect no  ecss dist/communicator.h
expect no  ecss parallel/expert_parallel.h
expect yes parallel dist/communicator.h
expect yes parallel ecss/expert_store.h
expect no  parallel train/trainer.h
expect no  data run/config.h
expect yes run optim/adamw.h
expect no  run train/checkpoint.h
expect no  run ecss/ecss_experts.h
expect yes train ecss/ecss_experts.h
expect yes train run/checkpoint.h
expect no  infer train/trainer.h
expect yes eval infer/generate.h
expect no  eval train/checkpoint.h
expect no  infer eval/tasks.h
expect yes serve infer/batch_decoder.h
expect no  serve train/checkpoint.h
expect no  infer serve/engine.h
expect yes readers run/checkpoint.h
expect no  readers train/checkpoint.h
expect no  readers ecss/expert_store.h

# The include rule: the tree as it is passes; a copy of src/model with each escape planted in
# it fails, naming every one (the compiler would have accepted them: ".." is resolved beside
# the including file, outside any include root).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
checks=$((checks + 1))
if ! out=$("$src/scripts/check_includes.sh" "$src/src" "$src/apps" 2>&1); then
  echo "the source tree breaks the include rule: $out"; fail=1
fi
mkdir -p "$tmp/src/model"
cp "$src"/src/model/*.h "$tmp/src/model/"
printf '#include "../optim/grad_norm.h"\n' > "$tmp/src/model/up1.cpp"
printf '#include "model/../optim/grad_norm.h"\n' > "$tmp/src/model/up2.cpp"
printf '#include "%s/src/optim/grad_norm.h"\n' "$src" > "$tmp/src/model/up3.cpp"
printf '#define GRAD_NORM "../optim/grad_norm.h"\n#include GRAD_NORM\n' > "$tmp/src/model/up4.cpp"
printf '#\\\ninclude "../optim/grad_norm.h"\n' > "$tmp/src/model/up5.cpp"
printf '%%:include "../optim/grad_norm.h"\n' > "$tmp/src/model/up6.cpp"
printf '#import "../optim/grad_norm.h"\n' > "$tmp/src/model/up7.cpp"  # GCC's include-once
printf '#include_next "../optim/grad_norm.h"\n' > "$tmp/src/model/up8.cpp"
printf '#  import <optim/../optim/grad_norm.h>\n' > "$tmp/src/model/up9.cpp"
checks=$((checks + 1))
if out=$("$src/scripts/check_includes.sh" "$tmp/src" 2>&1); then
  echo "the include rule accepted includes that climb out of src/model"; fail=1
else
  for f in up1 up2 up3 up4 up5 up6 up7 up8 up9; do
    if [[ $out != *"$f.cpp"* ]]; then echo "the include rule missed $f.cpp: $out"; fail=1; fi
  done
fi

# Upward calls: planted targets (CMakeLists.txt), built here only.
links() {  # links TARGET: 0 when it builds; its output in $tmp/TARGET.log
  "$cmake" --build "$build" --target "$1" > "$tmp/$1.log" 2>&1
}
expect_link() {  # expect_link yes|no TARGET [SYMBOL named by the failure]
  checks=$((checks + 1))
  if links "$2"; then got=yes; else got=no; fi
  if [[ $got != "$1" ]]; then
    echo "linking $2: expected $1, got $got"; tail -n 20 "$tmp/$2.log"; fail=1
  elif [[ $1 == no ]] && ! grep -q "undefined reference.*$3" "$tmp/$2.log"; then
    echo "linking $2 failed, but not on $3:"; tail -n 20 "$tmp/$2.log"; fail=1
  fi
}
expect_link yes layers_planted_downward
expect_link no  layers_planted_upward holds_run
expect_link no  readers_planted_upward holds_run

if ((fail)); then echo "layering check FAILED"; exit 1; fi
echo "layering check passed: $checks of $checks"
