#!/usr/bin/env bash
# Installs `make deb`'s package with apt on a fresh, minimal Debian 12 (debootstrap into a
# temporary directory, from the machine's Debian mirror), then uses the install from there: the
# tools' --version, a 2-rank all-reduce checked by gradsync-bench under gradsync-run, and the
# Python package with its torch backend under /usr/bin/python3. Proves that the package
# declares what it needs. Root; downloads a minimal system and the package's dependencies
# (libtorch among them), so it is not part of `make test`.
#
#   scripts/check-deb-fresh.sh [--build build] [--keep DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
keep=""
while (($#)); do
  case $1 in
    --build) build=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    *) echo "usage: $0 [--build DIR] [--keep DIR]" >&2; exit 2 ;;
  esac
done
[[ $(id -u) == 0 ]] || { echo "check-deb-fresh: needs root (debootstrap, chroot)" >&2; exit 2; }
command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null

(cd "$build" && cpack -G DEB >/dev/null)
deb=$(ls -t "$build"/gradsync_*_amd64.deb | head -1)
root=${keep:-$(mktemp -d /tmp/gradsync-fresh-XXXXXX)}
mounted=()
cleanup() {
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
  [[ -n $keep ]] || rm -rf "$root"
}
trap cleanup EXIT

mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
echo "check-deb-fresh: debootstrap bookworm into $root from ${mirror:=http://deb.debian.org/debian}"
[[ -x $root/usr/bin/apt-get ]] || debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
for m in proc dev dev/shm; do
  mkdir -p "$root/$m"
  mount --bind "/$m" "$root/$m"
  mounted+=("$root/$m")
done
cp "$deb" "$root/tmp/"
echo "check-deb-fresh: apt-get install ./$(basename "$deb")"
chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "/tmp/$(basename "$deb")" \
  >"$root/tmp/apt.log" 2>&1 || { tail -30 "$root/tmp/apt.log"; exit 1; }
run() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp "$@"; }
for tool in gradsync-run gradsync-bench gradsync-advise gradsync-train gradsync-probe; do
  run "$tool" --version
done
run gradsync-run -n 2 -- gradsync-bench allreduce --check --min-bytes 4K --max-bytes 1M --iters 3
run /usr/bin/python3 -c "import gradsync, gradsync.torch, torch; \
print('python: gradsync', gradsync.__version__, 'torch', torch.__version__)"
echo "check-deb-fresh: the package installed on a fresh Debian 12 and ran"
