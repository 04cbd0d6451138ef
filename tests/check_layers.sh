#!/usr/bin/env bash
# The build's layering (CMakeLists.txt, docs/architecture.md): each layer compiles against an
# include root holding only itself and the layers below it. Checks, with the compiler, that a
# header of a lower layer is visible from a higher one and that an upward include fails.
# Usage: check_layers.sh CXX BUILD_DIR
set -euo pipefail
cxx=$1 layers=$2/layers
compiles() {  # compiles LAYER HEADER: 0 when HEADER is reachable from LAYER's include root
  echo "#include \"$2\"" | "$cxx" -std=c++20 -fsyntax-only -I "$layers/$1" -x c++ - 2>/dev/null
}
fail=0
expect() {  # expect yes|no LAYER HEADER
  if compiles "$2" "$3"; then got=yes; else got=no; fi
  if [[ $got != "$1" ]]; then echo "layer $2 including $3: expected $1, got $got"; fail=1; fi
}
expect yes model core/tensor.h
expect yes model kernels/cpu/gemm.h
expect no  model train/trainer.h
expect no  model ecss/expert_store.h
expect no  kernels model/model.h
expect no  core io/file.h
expect no  io train/checkpoint.h
expect yes ecss io/checkpoint_dir.h
expect no  ecss train/checkpoint.h
expect no  data train/config.h
expect yes train ecss/ecss_experts.h
expect no  infer train/trainer.h
expect yes eval infer/generate.h
expect no  eval train/checkpoint.h
expect no  infer eval/tasks.h
expect yes serve infer/batch_decoder.h
expect no  serve train/checkpoint.h
expect no  infer serve/engine.h
if ((fail)); then echo "layering check FAILED"; exit 1; fi
echo "layering check passed: 18 of 18"
