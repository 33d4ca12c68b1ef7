#!/usr/bin/env bash
# Install what netagent's demo or tests need on a fresh Debian machine, idempotently.
#   bootstrap.sh --demo   the demo only: kernel tools (apt) and the project with its demo extra (a minute or two)
#   bootstrap.sh          everything the tests need: also prometheus, the test extras, the Kubernetes
#                         test and real-node assets built from Go modules, and the netagent image
#                         (about 25 minutes on 2 cores the first time; docs/real-node.md)
# The project goes into a virtual environment in the checkout, .venv (run it as `.venv/bin/python -m
# netagent ...`); nothing is pip-installed into the system's or any other interpreter.
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
# The project's own interpreter: a venv per checkout, because the editable install points at this
# checkout (two clones never share one) and `rm -rf .venv` undoes it all. Built from the python3 on
# PATH; its packages never leak in (no --system-site-packages) and pip never writes to it.
venv=.venv
py=$venv/bin/python
base=$(command -v python3 || true)
[[ -n $base ]] || { echo "bootstrap: no python3 on PATH (apt-get install python3 python3-venv)" >&2; exit 1; }
"$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "bootstrap: $base is Python $("$base" -c 'import platform; print(platform.python_version())'); netagent needs 3.11 or newer" >&2; exit 1; }
# reuse the venv only if it runs, has pip and belongs to this checkout (a moved checkout's scripts point elsewhere)
if [[ -e $venv ]] && ! { "$py" -m pip --version >/dev/null 2>&1 && [[ $(cat "$venv/.checkout" 2>/dev/null) == "$PWD" ]]; }; then
  echo "bootstrap: $venv is broken or from another checkout; making it again"
  rm -rf "$venv"
fi
if [[ ! -e $venv ]]; then
  echo "bootstrap: python3 -m venv $venv (from $base)"
  if ! "$base" -m venv "$venv" >/dev/null 2>&1; then
    # Debian's python3 ships venv without ensurepip: that is the python3-venv package
    rm -rf "$venv"
    echo "bootstrap: apt-get install python3-venv"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    "$base" -m venv "$venv"
  fi
  echo "$PWD" >"$venv/.checkout"
fi
# A re-run with the same pyproject.toml does no pip at all: the stamp names what the last install had.
stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $("$py" -c 'import sys; print(sys.version)' | head -n1)"
installed_for() { [[ $(cat "$venv/.installed-$1" 2>/dev/null) == "$stamp" ]]; }
imports="import cli, core, netagent, tc, iptables, controller, pyroute2, prometheus_client, rich, matplotlib"
if installed_for test || { ((demo_only)) && installed_for demo; }; then
  echo "bootstrap: $venv has .[$extra] (pyproject.toml unchanged)"
else
  # pip's HTTP cache keeps nothing where a proxy strips caching headers (ours do), so the wheels are
  # kept in a machine-level wheelhouse beside the Kubernetes assets: a fresh clone installs offline.
  # A new or changed requirement the wheelhouse cannot meet is downloaded into it first.
  wheels=${NETAGENT_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/netagent/wheels}
  mkdir -p "$wheels"
  offline=("$py" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheels" -e ".[$extra]")
  echo "bootstrap: pip install -e .[$extra] into $venv"
  if ! "${offline[@]}" >/dev/null 2>&1; then
    echo "bootstrap: pip wheel .[$extra] into $wheels (downloads what the wheelhouse lacks)"
    "$py" -m pip wheel -q --disable-pip-version-check --find-links "$wheels" -w "$wheels" ".[$extra]" "setuptools>=68" wheel
    rm -f "$wheels"/netagent-*.whl  # this checkout's own wheel: installed editable, never from here
    "${offline[@]}"
  fi
  "$py" -c "$imports" || { echo "bootstrap: the Python install into $venv failed" >&2; exit 1; }
  echo "$stamp" >"$venv/.installed-$extra"
fi
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
