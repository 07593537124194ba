#!/usr/bin/env bash
# Mutation testing with cargo-mutants (https://mutants.rs), the unit tests as the test tool.
#
#   scripts/mutants.sh [--in-diff BASE] [PATH.rs ...]
#
# PATHs are source files (default: the trust-boundary modules and parsers listed below). Each
# file is one run: its mutants are built and tested in place (cargo-mutants edits the file and
# restores it; the tree is never copied), one at a time, with `cargo test -p <its crate> --lib`.
# With --in-diff BASE only mutants on lines changed since the merge base with BASE are tried
# (the bounded run CI can afford). Results: target/mutants/<file>/mutants.out/{caught,missed,
# timeout,unviable}.txt. Exit status: 0 when no mutant was missed or timed out, else the worst
# cargo-mutants status (2 missed, 3 timeout, 4 baseline failed). Known equivalent mutants are
# excluded by scripts/mutants.toml; docs/TESTING.md says why each one is.
#
# HAKO_CARGO_LOCK=/path: take `flock -o` on that file around each file's run, so other builds
# on the machine can go between runs. Requires cargo-mutants (`cargo install cargo-mutants
# --locked`).
set -uo pipefail
cd "$(dirname "$0")/.."

DEFAULT=(
  runtime/src/cdi.rs
  runtime/src/spec.rs
  runtime/src/seccomp.rs
  runtime/src/logs.rs
  src/image/hosts.rs
  src/inroot.rs
  src/pods/rootfs.rs
  src/image/unpack.rs
)

base=""
files=()
while [ $# -gt 0 ]; do
  case "$1" in
    --in-diff) base="${2:?--in-diff needs a base revision}"; shift 2 ;;
    --in-diff=*) base="${1#--in-diff=}"; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) echo "mutants.sh: unknown option $1" >&2; exit 64 ;;
    *) files+=("$1"); shift ;;
  esac
done
[ ${#files[@]} -gt 0 ] || files=("${DEFAULT[@]}")

command -v cargo-mutants >/dev/null || { echo "mutants.sh: cargo-mutants is not installed (cargo install cargo-mutants --locked)" >&2; exit 1; }

diff_file=""
if [ -n "$base" ]; then
  mkdir -p target/mutants
  diff_file="$PWD/target/mutants/in-diff.patch"
  merge_base=$(git merge-base "$base" HEAD) || { echo "mutants.sh: no merge base with $base" >&2; exit 1; }
  # The working tree against the merge base: committed and uncommitted changes alike.
  git diff "$merge_base" -- "${files[@]}" > "$diff_file"
  if [ ! -s "$diff_file" ]; then
    echo "mutants.sh: none of the files changed since $base ($merge_base)"
    exit 0
  fi
fi

lock() {
  if [ -n "${HAKO_CARGO_LOCK:-}" ]; then flock -o "$HAKO_CARGO_LOCK" "$@"; else "$@"; fi
}

worst=0
summary=()
for f in "${files[@]}"; do
  [ -f "$f" ] || { echo "mutants.sh: no such file $f" >&2; exit 64; }
  case "$f" in
    runtime/*) pkg=hako-runtime ;;
    proto/*) pkg=hako-proto ;;
    *) pkg=hako ;;
  esac
  if [ -n "$diff_file" ] && ! grep -q "^+++ b/$f\$" "$diff_file"; then
    continue
  fi
  out="target/mutants/${f//\//_}"
  mkdir -p "$out"
  args=(
    --in-place --no-shuffle --colors never
    --config scripts/mutants.toml
    -p "$pkg" --file "$f"
    # --lib for the build too: building the e2e test binaries would multiply each mutant's time.
    -C --lib
    --timeout 20 --build-timeout 600
    -o "$out"
  )
  [ -n "$diff_file" ] && args+=(--in-diff "$diff_file")
  echo "== $f ($pkg)"
  lock cargo mutants "${args[@]}"
  rc=$?
  [ $rc -gt $worst ] && worst=$rc
  counts=""
  for k in caught missed timeout unviable; do
    n=$( (grep -c . "$out/mutants.out/$k.txt" 2>/dev/null) || true)
    counts+="$k ${n:-0}  "
  done
  summary+=("$f: $counts(exit $rc)")
done

echo
echo "mutation testing summary:"
for s in "${summary[@]}"; do echo "  $s"; done
exit $worst
