#!/usr/bin/env bash
# Builds containerd and its runc shim from the github.com/containerd/containerd/v2 Go module,
# for benchmarks beside Debian's containerd 1.6. Usage: build-containerd.sh OUT_DIR
# (CONTAINERD_VERSION overrides the version). Leaves OUT_DIR/containerd and
# OUT_DIR/containerd-shim-runc-v2; skips what is already built at this version.
# Run it under the machine-wide lock: flock -o /tmp/hako-cargo.lock .ci/build-containerd.sh DIR
set -euo pipefail
VERSION=${CONTAINERD_VERSION:-v2.2.1}
OUT=${1:?usage: build-containerd.sh OUT_DIR}
mkdir -p "$OUT"
if [ -x "$OUT/containerd" ] && [ -x "$OUT/containerd-shim-runc-v2" ] \
  && [ "$(cat "$OUT/.containerd-version" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
export GOFLAGS=-buildvcs=false
mod=github.com/containerd/containerd/v2
dir=$(go mod download -json "$mod@$VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p')
[ -n "$dir" ] || { echo "cannot download $mod@$VERSION" >&2; exit 1; }
work=$(mktemp -d)
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
cp -r "$dir/." "$work/"
chmod -R u+w "$work"
cd "$work"
# The module zip carries vendor/ but go may reject its modules.txt (it is checked against
# go.mod); then fetch the dependencies instead.
flags=-mod=vendor
if ! go list -mod=vendor ./cmd/containerd >/dev/null 2>&1; then
  flags=-mod=mod
fi
ldflags="-s -w -X $mod/version.Version=$VERSION -X $mod/version.Package=$mod"
# No btrfs headers needed: the benchmarks use the overlay snapshotter.
tags="no_btrfs"
CGO_ENABLED=1 go build $flags -tags "$tags" -ldflags "$ldflags" -o "$OUT/containerd" ./cmd/containerd
CGO_ENABLED=0 go build $flags -tags "$tags" -ldflags "$ldflags" -o "$OUT/containerd-shim-runc-v2" ./cmd/containerd-shim-runc-v2
echo "$VERSION" > "$OUT/.containerd-version"
