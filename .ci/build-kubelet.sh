#!/usr/bin/env bash
# Builds kubelet and kubeadm from the k8s.io/kubernetes Go module. Usage: build-kubelet.sh OUT_DIR.
# Skips what is already built at this version. KUBERNETES_BUILD_TARGETS names other binaries
# instead (any of kubelet, kubeadm, e2e_node.test, agnhost; scripts/node-conformance.sh uses the
# last two).
#
# k8s.io/kubernetes cannot be required as is: its go.mod replaces every k8s.io/* staging module
# with ./staging/..., which a dependent module does not see. So a throwaway wrapper module
# requires it and replaces each staging module (the list is read from its go.mod) with the
# matching v0.Y.Z release.
set -euo pipefail
VERSION=${KUBERNETES_VERSION:-v1.37.2}
OUT=${1:?usage: build-kubelet.sh OUT_DIR}
TARGETS=${KUBERNETES_BUILD_TARGETS:-kubelet kubeadm}
mkdir -p "$OUT"
# target -> the package it is built from
package_of() {
  case $1 in
    kubelet) echo k8s.io/kubernetes/cmd/kubelet ;;
    kubeadm) echo k8s.io/kubernetes/cmd/kubeadm ;;
    e2e_node.test) echo k8s.io/kubernetes/test/e2e_node ;;
    agnhost) echo k8s.io/kubernetes/test/images/agnhost ;;
    *) echo "unknown target $1" >&2; exit 1 ;;
  esac
}
built=1
for t in $TARGETS; do
  package_of "$t" >/dev/null
  [ -x "$OUT/$t" ] || built=0
done
if [ $built = 1 ] && [ "$(cat "$OUT/.kubernetes-version" 2>/dev/null)" = "$VERSION" ]; then
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
# A build-tagged file keeps the targets' packages in the module graph for `go mod tidy`.
{
  printf '//go:build tools\n\npackage tools\n\nimport (\n'
  for t in $TARGETS; do printf '\t_ "%s"\n' "$(package_of "$t")"; done
  printf ')\n'
} > tools.go
go mod tidy
ldflags=""
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  ldflags+=" -X '$pkg.gitVersion=$VERSION' -X '$pkg.gitMajor=$major' -X '$pkg.gitMinor=$minor'"
  ldflags+=" -X '$pkg.gitTreeState=clean'"
  ldflags+=" -X '$pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)'"
done
for t in $TARGETS; do
  case $t in
    # The suite's specs live in _test.go files: a test binary.
    e2e_node.test) go test -c -ldflags "$ldflags" -o "$OUT/$t" "$(package_of "$t")" ;;
    # Static: it runs in a busybox image without the host's libc.
    agnhost) CGO_ENABLED=0 go build -ldflags "$ldflags" -o "$OUT/$t" "$(package_of "$t")" ;;
    *) go build -ldflags "$ldflags" -o "$OUT/$t" "$(package_of "$t")" ;;
  esac
done
echo "$VERSION" > "$OUT/.kubernetes-version"
