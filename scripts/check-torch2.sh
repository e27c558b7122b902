#!/usr/bin/env bash
# Compiles (-fsyntax-only) the torch backend against Debian trixie's libtorch-dev 2.x headers,
# the c10d::Backend side of torch_backend.h's version switch, which this Debian 12 machine's
# torch 1.13 cannot build. A manual check, not part of CI: it fetches the .deb from Debian's
# archive into a scratch directory and installs nothing. Usage: scripts/check-torch2.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
scratch="${1:-/tmp/gradsync-torch2}"
mkdir -p "$scratch/lists/partial" "$scratch/cache/archives/partial" "$scratch/extra/torch"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  >"$scratch/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$scratch/sources.list" -o Dir::Etc::sourceparts=/dev/null
          -o "Dir::State::Lists=$scratch/lists" -o "Dir::Cache=$scratch/cache")
apt-get "${apt_opts[@]}" update >/dev/null
(cd "$scratch" && apt-get "${apt_opts[@]}" download libtorch-dev >/dev/null 2>&1)
deb=$(ls "$scratch"/libtorch-dev_*.deb | head -1)
version=$(dpkg-deb -f "$deb" Version)
rm -rf "$scratch/root" && dpkg -x "$deb" "$scratch/root"
# The package has no torch/version.h (python3-torch generates it): state the version it is.
IFS=. read -r major minor _ <<<"${version%%+*}"
printf '#pragma once\n#define TORCH_VERSION_MAJOR %s\n#define TORCH_VERSION_MINOR %s\n#define TORCH_VERSION "%s"\n' \
  "$major" "$minor" "${version%%+*}" >"$scratch/extra/torch/version.h"
inc="$scratch/root/usr/include"
python_inc=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
for f in python/src/torch_tensors.cc python/src/torch_backend.cc python/src/torch_module.cc; do
  c++ -fsyntax-only -std=c++20 -Wall -Wextra -Werror -Wno-restrict -D_GLIBCXX_USE_CXX11_ABI=1 \
    -DUSE_C10D_GLOO -Iinclude -Ipython/src -isystem "$scratch/extra" -isystem "$inc" \
    -isystem "$inc/torch/csrc/api/include" -isystem "$python_inc" "$f"
  echo "check-torch2: $f compiles against libtorch-dev $version"
done
