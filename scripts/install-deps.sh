#!/usr/bin/env bash
# Installs Sigma's build and test dependencies from Debian 12 packages.
# Idempotent and quiet: does nothing (and prints nothing) when everything is present.
# Usage: scripts/install-deps.sh [--bench|--fuzz]   (--bench adds python3-torch, the benchmark
# peer; --fuzz adds clang and libFuzzer)
set -euo pipefail
pkgs=(g++ cmake ninja-build pkg-config libdnnl-dev libomp-dev nlohmann-json3-dev libcli11-dev
      libfmt-dev libxxhash-dev ocl-icd-opencl-dev libgtest-dev libgmock-dev libbenchmark-dev python3-numpy
      libopenmpi-dev openmpi-bin gnuplot-nox python3 libcpp-httplib-dev iproute2
      default-jdk-headless  # Java code tasks: the JDK compiles samples (docs/dependencies.md)
      libsimde-dev  # tests: the AVX-512 GEMV kernels emulated where the CPU lacks AVX-512
      ccache)  # CMakeLists.txt compiles through it: rebuilds and CI's clean clones reuse objects
# sigma serve's end-to-end test runs the openai npm client: Debian's node and npm, unless a node
# with its own npm (e.g. NodeSource's package) is already there.
# npm fetches over HTTPS: ca-certificates is only a Recommends of nodejs, so name it.
command -v npm >/dev/null || pkgs+=(nodejs npm ca-certificates)
# The peer needs OpenBLAS: with --no-install-recommends torch falls back to the reference BLAS
# (~5 GFLOP/s) and the comparison is meaningless.
[[ "${1:-}" == "--bench" ]] && pkgs+=(python3-torch libopenblas0)
# libFuzzer runs (-DSIGMA_FUZZ=ON, docs/reliability.md); CI's in-ctest fuzz replay needs neither.
[[ "${1:-}" == "--fuzz" ]] && pkgs+=(clang libclang-rt-14-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]} == 0)) && exit 0
echo "install-deps: installing ${missing[*]}"
sudo_cmd=(); [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
