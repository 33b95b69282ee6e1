#!/usr/bin/env bash
# Builds every tests/fuzz/fuzz_*.c as a libFuzzer binary against the core
# (src/ledger.c, src/board*.c but the binding, src/probe*.c, include/) with
# ASan and UBSan, and runs each for a bounded time over its corpus
# tests/fuzz/corpus/<name>/.
# Any crash, sanitizer report, leak or invariant abort fails the run; the
# reproducer is left in the build directory (crash-*, leak-*, timeout-*).
#
# Environment:
#   FUZZ_SECONDS  seconds per harness (default 60); 0 only replays the
#                 committed corpus once (a quick regression run)
#   FUZZ_BUILD    build directory (default .ci/build-fuzz)
#   FUZZ_ONLY     run only the harnesses whose names are listed (e.g.
#                 "fuzz_ledger"), space separated
#   FUZZ_JOBS     libFuzzer -fork jobs per harness (default 1)
#   CC            the compiler (default clang; libFuzzer needs clang)
#
# New inputs that libFuzzer finds go to the build directory, never into the
# committed corpus; to keep a useful one, copy it there (see README.md).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"

seconds="${FUZZ_SECONDS:-60}"
build="${FUZZ_BUILD:-.ci/build-fuzz}"
cc="${CC:-clang}"
jobs="${FUZZ_JOBS:-1}"
mkdir -p "$build"

core=(src/ledger.c src/board.c src/board_host.c src/board_worker.c src/probe.c
      src/probe_cuda.c src/probe_nvml.c)
flags=(-std=c11 -g -O1 -fno-omit-frame-pointer -D_GNU_SOURCE
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
       -Iinclude -Isrc -I"$here")
# The harness is held to -Werror; the core's warnings are the meson
# --werror build's business (clang and gcc warn differently).
harness_flags=(-Wall -Wextra -Werror -Wno-unused-parameter)

shopt -s nullglob
harnesses=("$here"/fuzz_*.c)
if [ "${#harnesses[@]}" -eq 0 ]; then
  echo "no tests/fuzz/fuzz_*.c found" >&2
  exit 1
fi

echo "---- core: build"
objects=()
for unit in "${core[@]}"; do
  object="$build/$(basename "$unit" .c).o"
  "$cc" "${flags[@]}" -c "$unit" -o "$object"
  objects+=("$object")
done

# Fake libraries a harness loads at run time (tests/fuzz/lib_*.c), built
# next to the binaries as lib_*.so.
for unit in "$here"/lib_*.c; do
  "$cc" -std=c11 -g -O1 -shared -fPIC -fvisibility=hidden \
    -Wall -Wextra -Werror -Wno-unused-parameter -I"$here" \
    "$unit" -o "$build/$(basename "$unit" .c).so"
done

failed=0
summary=()
for source in "${harnesses[@]}"; do
  name="$(basename "$source" .c)"
  if [ -n "${FUZZ_ONLY:-}" ] && [[ " $FUZZ_ONLY " != *" $name "* ]]; then
    continue
  fi
  binary="$build/$name"
  echo "---- $name: build"
  "$cc" "${flags[@]}" "${harness_flags[@]}" "$source" "${objects[@]}" \
    -o "$binary" -pthread -ldl
  seeds="tests/fuzz/corpus/$name"
  if [ ! -d "$seeds" ] || [ -z "$(ls -A "$seeds")" ]; then
    echo "$name: no seed corpus in $seeds (commit a few inputs)" >&2
    failed=1
    continue
  fi
  work="$build/corpus-$name"
  mkdir -p "$work"
  log="$build/$name.log"
  if [ "$seconds" = 0 ]; then
    args=(-runs=0 "$seeds")
  else
    args=(-max_total_time="$seconds" "$work" "$seeds")
    if [ "$jobs" -gt 1 ]; then
      args=(-fork="$jobs" "${args[@]}")
    fi
  fi
  echo "---- $name: run (${seconds}s)"
  set +e
  ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}" \
  UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}" \
    "$binary" -print_final_stats=1 -timeout=20 -rss_limit_mb=2048 \
      -artifact_prefix="$build/$name-" "${args[@]}" >"$log" 2>&1
  rc=$?
  set -e
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  corpus_size="$(find "$work" "$seeds" -type f | wc -l)"
  if [ "$rc" -ne 0 ]; then
    tail -n 60 "$log" >&2
    echo "$name: FAILED (exit $rc); reproducer: $build/$name-*" >&2
    failed=1
    summary+=("$name: FAILED after ${execs:-?} executions")
  else
    line="$name: ${execs:-?} executions in ${seconds}s, no crash"
    summary+=("$line (corpus $corpus_size inputs)")
  fi
done

echo "---- fuzzing summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
