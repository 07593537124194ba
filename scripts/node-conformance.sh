#!/usr/bin/env bash
# Runs Kubernetes' node conformance suite (test/e2e_node, the NodeConformance specs without
# Serial, Slow, Flaky, Disruptive or Feature labels) against hako, as root:
#
#   scripts/node-conformance.sh [REPORT_DIR]
#
# Builds kubelet, e2e_node.test and agnhost from k8s.io/kubernetes (.ci/build-kubelet.sh, the
# same wrapper module; skipped when built), then runs tests/node_conformance.rs, which starts
# a local registry with the suite's images under their registry.k8s.io names, hako, the suite's
# own etcd + API server and kubelet, runs the suite and writes into REPORT_DIR (default
# target/node-conformance/report): report.json and junit.xml (ginkgo), summary.txt, and the
# logs of the suite, kubelet, hako and the API server.
#
# Environment:
#   HAKO_NODE_CONFORMANCE_SHARDS  run the spec list in this many sittings (default 1), each
#                                 under its own hold of the machine-wide build lock, reports in
#                                 REPORT_DIR/shard-I
#   HAKO_NODE_CONFORMANCE_PROCS   suite processes per sitting sharing the node (default 3), as
#                                 ginkgo's parallel mode runs non-Serial specs
#   HAKO_NODE_CONFORMANCE_FOCUS   a ginkgo focus regexp: only those specs (of the label filter)
#   HAKO_NODE_CONFORMANCE_SKIP    a ginkgo skip regexp: specs left out (the summary names them)
#   HAKO_NODE_CONFORMANCE_ATTEMPTS  run a failed spec again, up to this many attempts in all
#                                 (default 1; the summary names every spec that took more)
#   HAKO_NODE_CONFORMANCE_STRICT=1  fail unless every spec run passed (or the suite skipped it)
#   HAKO_NODE_CONFORMANCE_LABELS  the label filter (default: the one above)
#   HAKO_NODE_CONFORMANCE_NICE=1  run at nice 10 outside the lock (it uses port 6443: not
#                                 while tests/kubelet.rs's kubeadm preflight runs)
#   KUBERNETES_VERSION            default v1.37.2
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "node-conformance.sh: run as root" >&2; exit 1; }
export PATH="$HOME/.cargo/bin:/usr/local/go/bin:$PATH"
bin=$PWD/target/node-conformance/bin
report=$(realpath -m "${1:-target/node-conformance/report}")
lock=(flock -o /tmp/hako-cargo.lock)
start=$(date +%s)
# One hold of the lock for the builds (each a no-op when done).
"${lock[@]}" bash -c 'bash .ci/build-kubelet.sh "$PWD/.tools" &&
  KUBERNETES_BUILD_TARGETS="e2e_node.test agnhost" bash .ci/build-kubelet.sh "$0" &&
  cargo test --test node_conformance --no-run' "$bin"
built=$(date +%s)
rm -rf "$report"
run=(cargo test --test node_conformance -- --ignored --nocapture)
[ "${HAKO_NODE_CONFORMANCE_NICE:-}" = 1 ] && run=(nice -n 10 "${run[@]}") || run=("${lock[@]}" "${run[@]}")
export HAKO_NODE_CONFORMANCE_BIN=$bin
shards=${HAKO_NODE_CONFORMANCE_SHARDS:-1}
for i in $(seq 1 "$shards"); do
  dir=$report
  [ "$shards" = 1 ] || dir=$report/shard-$i
  HAKO_NODE_CONFORMANCE_SHARD=$i/$shards HAKO_NODE_CONFORMANCE_REPORT=$dir "${run[@]}"
  head -1 "$dir/summary.txt"
done
echo "build $((built - start)) s, suite $(($(date +%s) - built)) s; report in $report"
