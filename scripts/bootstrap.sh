#!/usr/bin/env bash
# Install what netagent's demo or tests need on a fresh Debian machine, idempotently.
#   bootstrap.sh --demo   the demo only: kernel tools (apt) and the project with its demo extra (a minute or two)
#   bootstrap.sh          everything the tests need: also prometheus, the test extras, the Kubernetes
#                         test and real-node assets built from Go modules, and the netagent image
#                         (about 25 minutes on 2 cores the first time; docs/real-node.md)
set -euo pipefail
cd "$(dirname "$0")/.."
demo_only=0
case "${1:-}" in
  --demo) demo_only=1 ;;
  "") ;;
  *) echo "usage: $0 [--demo]" >&2; exit 2 ;;
esac

if [[ $(id -u) -ne 0 ]]; then
  echo "bootstrap: run as root (netagent programs iptables and tc; the tests build network namespaces)" >&2
  exit 1
fi

apt_packages=(iproute2 iptables ipset iperf3 conntrack iputils-ping kmod procps)
# the tests: also prometheus and wrk; runc under containerd and busybox for the real node's images (tests/node.py);
# buildah and debootstrap build the netagent image (hack/image/build.sh, tests/test_install.py)
((demo_only)) || apt_packages+=(make openssl prometheus wrk ca-certificates runc busybox-static buildah debootstrap)
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

extra=test
((demo_only)) && extra=demo
echo "bootstrap: pip install -e .[$extra]"
python3 -m pip install -q --disable-pip-version-check -e ".[$extra]" 2>&1 | grep -v "Running pip as the 'root' user" || true
python3 -c "import cli, core, netagent, tc, iptables, controller, pyroute2, prometheus_client, rich, matplotlib" \
  || { echo "bootstrap: the Python install failed" >&2; exit 1; }
((demo_only)) && exit 0

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
# the netagent image (its Debian base once, then the Dockerfile with buildah's layer cache)
if [[ -f Makefile ]] && grep -q '^image:' Makefile; then
  make --no-print-directory image
fi
