#!/usr/bin/env bash
# Installs every Debian package gradsync needs to build, test and benchmark.
# Idempotent: installs only what is missing, so `make run`/`make test` can call it each time.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  googletest libgtest-dev libgmock-dev libbenchmark-dev   # tests and micro-benchmarks
  clang libclang-rt-14-dev                                # libFuzzer targets and sanitizer runtimes
  openmpi-bin libopenmpi-dev libgloo-dev                  # peers for side-by-side benchmarks
  python3-torch libopenblas0                              # PyTorch peer (codec ops, DDP), fast BLAS
  libtorch-dev pybind11-dev python3-numpy python3-pytest  # the Python package and torch backend
  libopenblas-dev zlib1g-dev dataset-fashion-mnist        # the trainer: BLAS, gzip, its data set
  nlohmann-json3-dev                                      # the advisor's profiles (JSON)
  libssl-dev                                              # HMAC-SHA256 of the token handshakes
  libucx-dev                                              # the ucx transport (RDMA, its tcp, sm)
  python3-torchvision                                     # bench/advise/published.py: the layers
                                                          # of published models (ResNet, VGG, ...)
  iproute2 procps psmisc                                  # launcher/failure tests (ip, pkill, fuser),
                                                          # network-namespace hosts (ip netns, tc)
  gnuplot-nox                                             # bench/netns scaling plot
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing packages: ${missing[*]} (run as root or install them)" >&2
    exit 1
  fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
