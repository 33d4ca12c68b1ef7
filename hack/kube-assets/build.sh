#!/usr/bin/env bash
# Build the Kubernetes test assets (etcd, kube-apiserver, kubectl, kwok, kube-scheduler,
# kube-controller-manager) from their Go modules into a machine-level cache, building only the
# binaries that are missing. Prints the bin directory on the last line of stdout.
#
# Environment:
#   NETAGENT_KUBE_ASSETS  bin directory to use (default: $XDG_CACHE_HOME/netagent/kube-assets/<k8s>/bin)
#   GOPROXY, GOMODCACHE, GOCACHE  the usual Go settings
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

kube_version=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/go.mod" | head -n1)
required_go=$(awk '$1 == "go" { print $2; exit }' "$here/go.mod")
[[ -n $kube_version ]] || { echo "kube-assets: no k8s.io/kubernetes version in $here/go.mod" >&2; exit 1; }

bin_dir="${NETAGENT_KUBE_ASSETS:-${XDG_CACHE_HOME:-$HOME/.cache}/netagent/kube-assets/$kube_version/bin}"

# binary name -> Go package; etcd first and kube-apiserver second so the kube_api fixture can run
# as early as possible on a cold machine.
binaries=(etcd kube-apiserver kubectl kwok kube-scheduler kube-controller-manager)
declare -A package=(
  [etcd]=go.etcd.io/etcd/server/v3
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kubectl]=k8s.io/kubernetes/cmd/kubectl
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [kwok]=sigs.k8s.io/kwok/cmd/kwok
)
declare -A module_dir=([kwok]="$here/kwok")

# A binary is rebuilt when its module's go.mod/go.sum changed since it was built (a stamp next
# to it records them); binaries without a stamp (put there by hand) are used as they are.
module_stamp() { cat "$1/go.mod" "$1/go.sum" | sha256sum | cut -c1-16; }
missing=()
for b in "${binaries[@]}"; do
  stamp_file="$bin_dir/.$b.stamp"
  if [[ ! -x $bin_dir/$b ]] || { [[ -f $stamp_file ]] && [[ $(<"$stamp_file") != $(module_stamp "${module_dir[$b]:-$here}") ]]; }; then
    missing+=("$b")
  fi
done
if ((${#missing[@]} == 0)); then
  echo "kube-assets: Kubernetes $kube_version test binaries are up to date in:"
  echo "$bin_dir"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "kube-assets: Go is not installed (need go >= $required_go on PATH to build ${missing[*]})." >&2
  echo "kube-assets: install Go from https://go.dev/dl or your distribution, or point NETAGENT_KUBE_ASSETS at prebuilt binaries." >&2
  exit 1
fi
go_version=$(go env GOVERSION | sed 's/^go//')
if [[ $(printf '%s\n%s\n' "$required_go" "$go_version" | sort -V | head -n1) != "$required_go" ]]; then
  echo "kube-assets: Go $go_version is too old: Kubernetes $kube_version needs go >= $required_go ($(command -v go))." >&2
  exit 1
fi

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod -buildvcs=false"
mkdir -p "$bin_dir"
log_dir="$(dirname "$bin_dir")/logs"
mkdir -p "$log_dir"

version_pkg=k8s.io/component-base/version
client_version_pkg=k8s.io/client-go/pkg/version
minor=$(echo "$kube_version" | cut -d. -f2)
kube_ldflags="-s -w"
for pkg in $version_pkg $client_version_pkg; do
  kube_ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

for b in "${missing[@]}"; do
  dir="${module_dir[$b]:-$here}"
  log="$log_dir/$b.build.log"
  ldflags="-s -w"
  [[ ${package[$b]} == k8s.io/* ]] && ldflags="$kube_ldflags"
  echo "kube-assets: building $b (${package[$b]}), log: $log"
  start=$SECONDS
  # Download first with a bound so an unreachable module proxy is reported as such.
  if ! (cd "$dir" && timeout 900 go mod download) >"$log" 2>&1; then
    echo "kube-assets: downloading the Go modules for $b failed; is the module proxy (GOPROXY=$(go env GOPROXY)) reachable?" >&2
    tail -n 5 "$log" >&2
    echo "kube-assets: full log: $log" >&2
    exit 1
  fi
  if ! (cd "$dir" && go build -trimpath -ldflags "$ldflags" -o "$bin_dir/$b.tmp" "${package[$b]}") >>"$log" 2>&1; then
    rm -f "$bin_dir/$b.tmp"
    echo "kube-assets: building $b failed:" >&2
    tail -n 20 "$log" >&2
    echo "kube-assets: full log: $log" >&2
    exit 1
  fi
  mv "$bin_dir/$b.tmp" "$bin_dir/$b"
  module_stamp "$dir" >"$bin_dir/.$b.stamp"
  echo "kube-assets: built $b in $((SECONDS - start)) s"
done
echo "kube-assets: Kubernetes $kube_version test binaries are in:"
echo "$bin_dir"
