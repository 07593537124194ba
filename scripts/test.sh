#!/usr/bin/env bash
# The whole test suite, as CI runs it (as root, on a clean clone): installs what it needs,
# builds crictl and critest from sigs.k8s.io/cri-tools and kubelet and kubeadm from
# k8s.io/kubernetes, then runs format and lint checks, the unit tests and the end-to-end tests
# (real registry, crictl, critest's must-pass list, a real kubelet and kubeadm).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "test.sh: run as root (the e2e tests mount, unpack devices, chown)" >&2; exit 1; }
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
bash scripts/deps.sh
bash .ci/build-cri-tools.sh "$PWD/.tools"
bash .ci/build-kubelet.sh "$PWD/.tools"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# Missing e2e prerequisites fail here instead of skipping.
export HAKO_E2E_REQUIRED=1
# libtest counts a skipped test as passed; tests record each skip (test, part, reason) here and
# the summary below lists them, whatever the run's outcome.
export HAKO_SKIP_LOG="$PWD/target/hako-skips.log"
rm -f "$HAKO_SKIP_LOG"
summary() {
  if [ -s "$HAKO_SKIP_LOG" ]; then
    echo "skipped in this run ($(wc -l < "$HAKO_SKIP_LOG")):"
    sed 's/^/  /' "$HAKO_SKIP_LOG"
  else
    echo "skipped in this run: none"
  fi
}
trap summary EXIT
cargo test --workspace --locked -- --test-threads=2
# Kubernetes' node conformance suite (test/e2e_node): all 432 NodeConformance specs (the label
# filter of scripts/node-conformance.sh) but the 4 these machines make fail, each required to
# pass. Left out, with their reasons (docs/CONFORMANCE.md):
#   Secrets/ConfigMap "consumable via the environment": Debian's busybox sh drops variable
#     names with '-' from the environment it passes on (the stand-in image's shell);
#   PrivilegedPod: `ip link add ... type dummy` needs the dummy module, absent here;
#   Summary API: expects PSI and the kubelet/runtime/misc system containers (cgroup v1 here).
# A spec that fails gets one more attempt, as Kubernetes' own node e2e jobs give; the summary
# names every spec that needed it. About 12 minutes on 16 suite processes.
# With them, the 7 ImageVolume specs (GA in 1.36, labelled Feature:ImageVolume, not NodeConformance)
# and the 9 user namespace ones (hostUsers: false, GA in 1.36, Feature:UserNamespacesSupport; one
# skips itself here: kubelet has no subordinate ID range configured).
HAKO_NODE_CONFORMANCE_LABELS='(NodeConformance && !Serial && !Slow && !Flaky && !Disruptive && Feature: isEmpty) || (Feature: containsAny {ImageVolume, UserNamespacesSupport} && !Serial && !Slow && !Flaky && !Disruptive)' \
HAKO_NODE_CONFORMANCE_STRICT=1 HAKO_NODE_CONFORMANCE_PROCS=16 HAKO_NODE_CONFORMANCE_ATTEMPTS=2 \
  HAKO_NODE_CONFORMANCE_SKIP='\[sig-node\] (Secrets|ConfigMap) should be consumable via the environment |\[sig-node\] PrivilegedPod should enable privileged commands |\[sig-node\] Summary API when querying /stats/summary should report resource usage through the stats api ' \
  bash scripts/node-conformance.sh target/node-conformance/ci
