# Sourced by the bench/torch scripts: one job under torchrun, with the flags Debian's 1.13
# needs under Python 3.11 (--redirects, --tee, --log_dir), on a free port (--standalone),
# bounded by a timeout so that a hung backend costs one cell, not the run. A failure is
# reported and the caller's table goes on.
#
#   torch_job OUT TIMEOUT_S NAME RANKS SCRIPT ARGS...
# writes OUT/NAME.json (the script's --json) and OUT/logs/NAME.txt.
torch_job() {
  local out=$1 timeout_s=$2 name=$3 n=$4 script=$5
  shift 5
  local rc=0
  mkdir -p "$out/logs"
  timeout "$timeout_s" /usr/bin/python3 -m torch.distributed.run --standalone \
    --nproc_per_node "$n" --redirects 1 --tee 1 --log_dir "$out/logs" \
    "$script" "$@" --json "$out/$name.json" >"$out/logs/$name.txt" 2>&1 || rc=$?
  if ((rc)); then
    local what="failed (status $rc)"
    ((rc == 124)) && what="timed out after $timeout_s s"
    echo "$(basename "$0"): $name $what; its output: $out/logs/$name.txt" >&2
    rm -f "$out/$name.json"
  fi
}
