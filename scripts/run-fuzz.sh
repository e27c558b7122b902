#!/usr/bin/env bash
# Builds the libFuzzer targets with clang into build-fuzz and runs each one for a bounded
# time; exits non-zero if any fuzzer finds a crash (the input is saved under
# build-fuzz/artifacts/). Usage: scripts/run-fuzz.sh [seconds per fuzzer, default 30]
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-${FUZZ_SECONDS:-30}}"
build=build-fuzz
targets=(frame_fuzz store_protocol_fuzz codec_fuzz)

CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRADSYNC_FUZZ=ON -DGRADSYNC_BUILD_BENCH=OFF -DGRADSYNC_PYTHON=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

mkdir -p "$build/artifacts"
for t in "${targets[@]}"; do
  # The corpus persists between runs, so each run starts where the last one stopped.
  corpus="$build/corpus/$t"
  mkdir -p "$corpus"
  log="$build/$t.log"
  echo "run-fuzz: $t for ${seconds}s"
  status=0
  "$build/fuzz/$t" "$corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$build/artifacts/$t-" -print_final_stats=1 >"$log" 2>&1 || status=$?
  tail -n 12 "$log"
  if [[ $status -ne 0 ]]; then
    echo "run-fuzz: $t failed (exit $status); full log $log, reproducer in $build/artifacts/" >&2
    exit "$status"
  fi
done
echo "run-fuzz: all fuzzers ran ${seconds}s without a finding"
