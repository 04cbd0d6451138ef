#!/usr/bin/env bash
# The layering's include rule, for what the include roots cannot stop (CMakeLists.txt,
# docs/architecture.md). A layer compiles against a root holding only itself and the layers it
# uses, so `#include "optim/grad_norm.h"` from src/model fails to compile. But a quoted include
# is first looked up beside the including file, and ".." climbs out of any root: "../optim/x.h",
# "model/../optim/x.h", an absolute path or a macro would reach every layer. So every include
# directive under the given folders must be a plain "path" or <path>, without "..", not absolute,
# on one logical line. The build runs this before compiling (target sigma_include_check).
# Usage: check_includes.sh DIR...   (exit 1 and one line per offending directive)
set -euo pipefail
files=$(find "$@" -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cc' -o -name '*.inc' \) | sort)
[[ -z $files ]] && exit 0
# Backslash-newlines are joined first (the preprocessor does it before anything else); a
# directive starts with '#', the digraph '%:' or the trigraph '??=', then spaces or comments;
# GCC's #import (include once) and #include_next include too, so only a plain #include passes.
# shellcheck disable=SC2086
bad=$(awk '
  FNR == 1 { buf = "" }
  {
    line = (buf != "") ? buf $0 : $0
    if (buf == "") start = FNR
    if (line ~ /\\$/) { buf = substr(line, 1, length(line) - 1); next }
    buf = ""
    if (line !~ /^[ \t]*(#|%:|\?\?=)([ \t]|\/\*.*\*\/)*(include|import)/) next
    if (line !~ /^[ \t]*#[ \t]*include[ \t]*("[^"\\\/][^"\\]*"|<[^>\\\/][^>\\]*>)[ \t]*(\/\/.*)?$/ || line ~ /\.\./)
      print FILENAME ":" start ": " line
  }' $files)
if [[ -n $bad ]]; then
  echo "$bad" | sed 's/^/include escapes its layer (no "..", absolute path or macro allowed): /'
  exit 1
fi
