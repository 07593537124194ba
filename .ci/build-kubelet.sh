#!/usr/bin/env bash
# Builds kubelet and kubeadm from the k8s.io/kubernetes Go module. Usage: build-kubelet.sh OUT_DIR.
# Skips what is already built at this version.
#
# k8s.io/kubernetes cannot be required as is: its go.mod replaces every k8s.io/* staging module
# with ./staging/..., which a dependent module does not see. So a throwaway wrapper module
# requires it and replaces each staging module (the list is read from its go.mod) with the
# matching v0.Y.Z release.
set -euo pipefail
VERSION=${KUBERNETES_VERSION:-v1.37.2}
OUT=${1:?usage: build-kubelet.sh OUT_DIR}
mkdir -p "$OUT"
if [ -x "$OUT/kubelet" ] && [ -x "$OUT/kubeadm" ] && [ "$(cat "$OUT/.kubernetes-version" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
export GOFLAGS="-buildvcs=false -mod=mod"
modfile=$(go mod download -json "k8s.io/kubernetes@$VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p')
[ -n "$modfile" ] || { echo "cannot download k8s.io/kubernetes@$VERSION" >&2; exit 1; }
# vMAJOR.MINOR.PATCH -> the staging modules' v0.MINOR.PATCH; the tag's pre-release part is kept.
minor_patch=${VERSION#v*.}
staging_version=v0.$minor_patch
major=${VERSION#v}
major=${major%%.*}
minor=${minor_patch%%.*}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
go_version=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$modfile")
{
  echo "module hako.test/kubelet-build"
  echo
  echo "go $go_version"
  echo
  echo "require k8s.io/kubernetes $VERSION"
  echo
  sed -n 's|^\s*\(k8s\.io/[^ ]*\) => \./staging/.*$|replace \1 => \1 '"$staging_version"'|p' "$modfile"
} > go.mod
grep -q '^replace ' go.mod || { echo "no staging modules found in $modfile" >&2; exit 1; }
# A build-tagged file keeps the two commands' packages in the module graph for `go mod tidy`.
cat > tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kubeadm"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
EOF
go mod tidy
ldflags=""
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  ldflags+=" -X '$pkg.gitVersion=$VERSION' -X '$pkg.gitMajor=$major' -X '$pkg.gitMinor=$minor'"
  ldflags+=" -X '$pkg.gitTreeState=clean'"
  ldflags+=" -X '$pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)'"
done
go build -ldflags "$ldflags" -o "$OUT/kubelet" k8s.io/kubernetes/cmd/kubelet
go build -ldflags "$ldflags" -o "$OUT/kubeadm" k8s.io/kubernetes/cmd/kubeadm
echo "$VERSION" > "$OUT/.kubernetes-version"
