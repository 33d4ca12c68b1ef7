#!/usr/bin/env bash
# Install everything netagent's demo and tests need on a fresh Debian machine, idempotently:
# kernel tools (apt), Python packages (pip), and the Kubernetes test assets built from Go modules.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $(id -u) -ne 0 ]]; then
  echo "bootstrap: run as root (netagent programs iptables and tc; the tests build network namespaces)" >&2
  exit 1
fi

apt_packages=(iproute2 iptables ipset iperf3 conntrack iputils-ping kmod procps make openssl prometheus wrk ca-certificates
  runc busybox-static)  # the real node (tests/node.py): runc under containerd, busybox for its images
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

echo "bootstrap: pip install -e .[test]"
python3 -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "Running pip as the 'root' user" || true
python3 -c "import netagent, tc, iptables, controller, pyroute2, prometheus_client" \
  || { echo "bootstrap: the Python install failed" >&2; exit 1; }

# Go for the Kubernetes test assets: the machines ship it in /usr/local/go, not always on PATH
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="$PATH:/usr/local/go/bin"
fi
if [[ -f Makefile ]] && grep -q '^kube-assets:' Makefile; then
  make --no-print-directory kube-assets
fi
# kubelet, containerd, CNI plugins, helm: after kube-assets, whose build cache makes the kubelet quick
if [[ -f Makefile ]] && grep -q '^node-assets:' Makefile; then
  make --no-print-directory node-assets
fi
