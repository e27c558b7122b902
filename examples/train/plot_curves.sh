#!/usr/bin/env bash
# Training curves of several gradsync-train runs in one PNG: loss and training-batch
# accuracy against the step and against wall time, one line per run (its --json file,
# labelled by its codec and flags). Needs gnuplot (scripts/install-deps.sh installs it).
#
#   examples/train/plot_curves.sh OUT.png RUN1.json [RUN2.json ...]
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
out=$1
shift
data=$(mktemp -d /tmp/plot_curves.XXXXXX)
trap 'rm -rf "$data"' EXIT
# One whitespace-separated file per run: step wall_s loss accuracy (losses smoothed over 20
# steps, so the codecs' curves can be told apart), and its title.
python3 - "$data" "$@" <<'PY'
import json, os, sys
data, runs = sys.argv[1], sys.argv[2:]
for i, path in enumerate(runs):
    d = json.load(open(path))
    c = d["config"]
    title = c["codec"]
    biased = ("int8", "topk", "randomk", "threshold", "sign", "powersgd")
    if title.startswith(biased) and "ef=1" not in title: title += ",ef=0"
    if not c.get("overlap", True): title += " no-overlap"
    if c.get("zero"): title += f" zero{c['zero']}"
    if c.get("accumulate", 1) > 1: title += f" acc{c['accumulate']}"
    title += f" ({100 * d['test_accuracy']:.2f}%)"
    losses, accs, walls = d["losses"], d["train_accuracy"], d["wall_at_step"]
    with open(os.path.join(data, f"{i}.dat"), "w") as f:
        for s in range(len(losses)):
            lo = max(0, s - 19)
            mean = lambda xs: sum(xs[lo:s + 1]) / (s + 1 - lo)
            f.write(f"{s + 1} {walls[s]:.3f} {mean(losses):.6f} {100 * mean(accs):.3f}\n")
    open(os.path.join(data, f"{i}.title"), "w").write(title.replace('"', "'"))
PY
plots() {  # plots XCOL YCOL
  local sep="" i
  for f in "$data"/*.dat; do
    local n=${f%.dat}
    printf '%s"%s" using %s:%s with lines title "%s"' "$sep" "$f" "$1" "$2" "$(cat "$n.title")"
    sep=", "
  done
}
gnuplot <<GP
set terminal pngcairo size 1400,900 noenhanced
set output "$out"
set multiplot layout 2,2 title "gradsync-train: training curves (20-step moving average)"
set grid
set key top right
# Cross-entropy over 10 classes starts at ln 10 = 2.3: a run that diverges past 3 is off
# the chart rather than flattening everyone else's curve.
set yrange [0:3]
set xlabel "step"; set ylabel "loss"
plot $(plots 1 3)
set xlabel "wall time (s)"; set ylabel "loss"
plot $(plots 2 3)
set yrange [*:*]
set key bottom right
set xlabel "step"; set ylabel "training accuracy (%)"
plot $(plots 1 4)
set xlabel "wall time (s)"; set ylabel "training accuracy (%)"
plot $(plots 2 4)
unset multiplot
GP
echo "plot_curves: wrote $out" >&2
