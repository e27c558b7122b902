#!/usr/bin/env bash
# A cluster of H "hosts" on this machine: one Linux network namespace per host, each joined
# to a switch by its own link, every link shaped to a rate with tc tbf (netem is not in this
# kernel). Tests and benchmarks run one gradsync-run per host in them, as a user runs one
# per machine. Needs root (ip netns, veth, tc).
#
#   scripts/netns-cluster.sh up   [--hosts H] [--rate R] [--prefix P] [--subnet A.B.C]
#                                 [--congestion cubic]
#   scripts/netns-cluster.sh exec [--prefix P] HOST cmd [args...]
#   scripts/netns-cluster.sh addr [--prefix P] HOST
#   scripts/netns-cluster.sh down [--prefix P]
#   scripts/netns-cluster.sh list [--prefix P]
#
# Layout: namespace P-sw holds a bridge; host i is namespace P-hI with interface eth0,
# address A.B.C.(10+i)/24, linked by a veth pair to the bridge. The root namespace is not
# touched, so nothing can leak onto the machine's real network. --rate shapes both
# directions of every host's link (tbf on eth0 for what the host sends, on the switch's end
# for what it receives), like a full-duplex NIC; "none" leaves them unshaped. The hosts' TCP
# congestion control is --congestion (default cubic, Linux's own default), not whatever this
# machine's sysctl says, which new namespaces inherit: under tbf, BBR carried 0.88-0.89 of the
# link where CUBIC carried 0.92-0.94 (docs/performance-notes.md); "inherit" keeps the machine's.
#
# `up` first removes a cluster left behind under the same prefix; `down` removes every
# namespace with the prefix (the veths go with them) and succeeds when there is nothing to
# remove, so a failed run can always be cleaned up.
set -euo pipefail

prefix=gs
hosts=2
rate=none
subnet=10.77.0
congestion=cubic

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

cmd=${1:-}; [[ -n $cmd ]] || usage; shift
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) hosts=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --prefix) prefix=$2; shift 2 ;;
    --subnet) subnet=$2; shift 2 ;;
    --congestion) congestion=$2; shift 2 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    -*) echo "netns-cluster: unknown option '$1'" >&2; usage ;;
    *) break ;;
  esac
done

# Interface names are limited to 15 characters: keep prefixes short.
if (( ${#prefix} > 8 )) || [[ ! $prefix =~ ^[a-z][a-z0-9]*$ ]]; then
  echo "netns-cluster: --prefix must be 1-8 lowercase letters/digits, starting with a letter" >&2
  exit 2
fi
sw="${prefix}-sw"
host_ns() { echo "${prefix}-h$1"; }

namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}-(sw|h[0-9]+)$" || true; }

down() {
  local ns
  for ns in $(namespaces); do ip netns del "$ns" 2>/dev/null || true; done
  # A veth whose namespace vanished goes with it; nothing else lives outside the namespaces.
}

shape() {  # shape NS DEV: tbf at $rate on DEV's egress
  local ns=$1 dev=$2
  [[ $rate == none ]] && return 0
  # burst: enough for ~2 ms at the rate (at least 64 KiB), so the 4 ms kernel timer tick does
  # not make tbf idle between refills; latency bounds the queue (like a NIC's buffers).
  local bits
  bits=$(rate_bits "$rate")
  local burst=$(( bits / 8 / 500 ))
  (( burst < 65536 )) && burst=65536
  ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 20ms
}

rate_bits() {  # 1gbit, 500mbit, 100kbit -> bits per second
  local r=${1,,}
  case "$r" in
    *gbit) echo $(( ${r%gbit} * 1000000000 )) ;;
    *mbit) echo $(( ${r%mbit} * 1000000 )) ;;
    *kbit) echo $(( ${r%kbit} * 1000 )) ;;
    *bit) echo "${r%bit}" ;;
    *) echo "netns-cluster: --rate like 1gbit, 500mbit or none" >&2; exit 2 ;;
  esac
}

up() {
  if [[ $(id -u) -ne 0 ]]; then echo "netns-cluster: needs root (ip netns, veth, tc)" >&2; exit 1; fi
  if (( hosts < 1 || hosts > 200 )); then echo "netns-cluster: --hosts 1..200" >&2; exit 2; fi
  [[ $rate == none ]] || rate_bits "$rate" >/dev/null
  down
  trap 'down' ERR
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  local i ns
  for ((i = 0; i < hosts; i++)); do
    ns=$(host_ns "$i")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    if [[ $congestion != inherit ]]; then
      ip netns exec "$ns" sysctl -qw net.ipv4.tcp_congestion_control="$congestion" 2>/dev/null || {
        echo "netns-cluster: --congestion $congestion: this kernel has no such TCP congestion" \
          "control (it has: $(cat /proc/sys/net/ipv4/tcp_available_congestion_control))" >&2
        down
        exit 2
      }
    fi
    # Created inside the host namespace (so the names cannot collide with the root's),
    # then the switch end moves to the switch.
    ip -n "$ns" link add eth0 type veth peer name "p$i"
    ip -n "$ns" link set "p$i" netns "$sw"
    ip -n "$sw" link set "p$i" master br0
    ip -n "$sw" link set "p$i" up
    ip -n "$ns" addr add "${subnet}.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    shape "$ns" eth0
    shape "$sw" "p$i"
  done
  # A link is usable some hundreds of milliseconds after "up" (carrier on both veth ends);
  # until then UCX does not list it as a device, so wait for every host's link to run.
  for ((i = 0; i < hosts; i++)); do
    ns=$(host_ns "$i")
    for ((try = 0; try < 100; try++)); do
      ip -n "$ns" link show eth0 | grep -q "state UP" && break
      sleep 0.05
    done
  done
  trap - ERR
  echo "netns-cluster: $hosts hosts up (prefix $prefix, rate $rate): $(for ((i = 0; i < hosts; i++)); do printf '%s=%s ' "$(host_ns "$i")" "${subnet}.$((10 + i))"; done)"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  list) namespaces ;;
  addr)
    [[ $# -ge 1 ]] || usage
    echo "${subnet}.$((10 + $1))" ;;
  exec)
    [[ $# -ge 2 ]] || usage
    h=$1; shift
    exec ip netns exec "$(host_ns "$h")" "$@" ;;
  *) usage ;;
esac
