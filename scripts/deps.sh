#!/usr/bin/env bash
# Installs what building, running and testing hako needs on Debian bookworm (run as root).
# Go (for crictl/critest) and Rust (cargo) are expected on PATH; everything else comes from apt.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(
  protobuf-compiler pkg-config libseccomp-dev   # build: the CRI api.proto, libcontainer's seccomp
  # busybox, not busybox-static: the static build runs applets inside sh instead of exec'ing
  # /bin/ls and friends, which critest's MaskedPaths spec relies on.
  docker-registry busybox procps util-linux      # tests: local registry, image stand-ins (pgrep, ipcs)
  apache2-utils openssl                          # tests: htpasswd and certificates for registry auth/TLS
  containernetworking-plugins iptables iproute2  # CNI plugins in /usr/lib/cni (portmap needs iptables)
  systemd                                        # tests: systemd-analyze verify of the unit
  libc6-dev apparmor                             # tests: static seccomp probe (cc -static); AppArmor profile syntax
  tmux                                           # tests: crictl exec -it in a terminal that is resized
)
missing=()
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for p in "${pkgs[@]}"; do
  installed "$p" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for tool in cargo go; do
  command -v "$tool" >/dev/null || { echo "deps.sh: $tool is not on PATH; install it first" >&2; exit 1; }
done
