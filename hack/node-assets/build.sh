#!/usr/bin/env bash
# Build the real-node assets for tests/node.py (a kubelet with containerd and the CNI plugins,
# wired to the harness's kube-apiserver) and helm, from their Go modules into a machine-level
# cache, building only the binaries that are missing or whose module changed. Prints the bin
# directory on the last line of stdout; the CNI plugins are in its cni/ subdirectory.
#
#   kubelet                          k8s.io/kubernetes, the same release and replaces as ../kube-assets
#   containerd, containerd-shim-runc-v2, ctr   github.com/containerd/containerd/v2 (containerd/)
#   cni/{ptp,bridge,host-local,loopback,portmap,bandwidth}   github.com/containernetworking/plugins (cni/)
#   helm                             helm.sh/helm/v4 (helm/)
#   crds/monitoring.coreos.com_{podmonitors,servicemonitors,prometheusrules}.yaml
#                                    the Prometheus operator's CRDs, copied from its module
#                                    (prometheus-operator/; checked against go.sum, nothing built)
#
# runc is not built here: it comes from Debian (apt-get install runc), as do buildah (images
# without a Docker engine) and busybox-static (the test images); see scripts/bootstrap.sh.
#
# Environment:
#   NETAGENT_NODE_ASSETS  bin directory to use (default: $XDG_CACHE_HOME/netagent/node-assets/<k8s>/bin)
#   NODE_ASSETS_ONLY      space-separated binary names to consider (default: all), e.g. "helm"
#   GOPROXY, GOMODCACHE, GOCACHE  the usual Go settings
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kube_assets="$here/../kube-assets"

mod_version() { awk -v m="$2" '$1 == m && $2 ~ /^v/ { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1/go.mod"; }
kube_version=$(mod_version "$here/kubelet" k8s.io/kubernetes)
containerd_version=$(mod_version "$here/containerd" github.com/containerd/containerd/v2)
cni_version=$(mod_version "$here/cni" github.com/containernetworking/plugins)
helm_version=$(mod_version "$here/helm" helm.sh/helm/v4)
for v in kube_version containerd_version cni_version helm_version; do
  [[ -n ${!v} ]] || { echo "node-assets: no ${v%_version} version found in $here/*/go.mod" >&2; exit 1; }
done

# The kubelet must be the release the harness runs (kube-apiserver from ../kube-assets), with the
# same staging-module replaces: refuse to build a skewed one.
harness_version=$(mod_version "$kube_assets" k8s.io/kubernetes)
if [[ $harness_version != "$kube_version" ]] \
  || ! diff <(sed -n '/^replace (/,/^)/p' "$kube_assets/go.mod") <(sed -n '/^replace (/,/^)/p' "$here/kubelet/go.mod") >/dev/null; then
  echo "node-assets: hack/node-assets/kubelet/go.mod ($kube_version) does not match hack/kube-assets/go.mod ($harness_version):" >&2
  echo "node-assets: set the same k8s.io/kubernetes version and replace block in both, then 'go mod tidy' in hack/node-assets/kubelet." >&2
  exit 1
fi

bin_dir="${NETAGENT_NODE_ASSETS:-${XDG_CACHE_HOME:-$HOME/.cache}/netagent/node-assets/$kube_version/bin}"

# binary (path under bin_dir) -> module directory, Go package, build tags, ldflags
binaries=(kubelet containerd containerd-shim-runc-v2 ctr
  cni/ptp cni/bridge cni/host-local cni/loopback cni/portmap cni/bandwidth helm)
declare -A module package tags ldflags
minor=$(echo "$kube_version" | cut -d. -f2)
kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
module[kubelet]=kubelet package[kubelet]=k8s.io/kubernetes/cmd/kubelet ldflags[kubelet]=$kube_ldflags

containerd_ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version"
containerd_ldflags+=" -X github.com/containerd/containerd/v2/version.Revision=module-proxy"
for b in containerd containerd-shim-runc-v2 ctr; do
  module[$b]=containerd package[$b]=github.com/containerd/containerd/v2/cmd/$b
  ldflags[$b]=$containerd_ldflags tags[$b]=urfave_cli_no_docs
done
tags[containerd-shim-runc-v2]="urfave_cli_no_docs no_grpc" # as containerd's Makefile builds the shim

declare -A cni_dir=([ptp]=main [bridge]=main [loopback]=main [host-local]=ipam [portmap]=meta [bandwidth]=meta)
for p in "${!cni_dir[@]}"; do
  module[cni/$p]=cni package[cni/$p]=github.com/containernetworking/plugins/plugins/${cni_dir[$p]}/$p
  ldflags[cni/$p]="-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$cni_version"
done

module[helm]=helm package[helm]=helm.sh/helm/v4/cmd/helm
ldflags[helm]="-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version"
ldflags[helm]+=" -X helm.sh/helm/v4/internal/version.metadata= -X helm.sh/helm/v4/internal/version.gitTreeState=clean"

if [[ -n ${NODE_ASSETS_ONLY:-} ]]; then
  for b in $NODE_ASSETS_ONLY; do
    [[ -n ${module[$b]:-} ]] || { echo "node-assets: unknown binary '$b' in NODE_ASSETS_ONLY (known: ${binaries[*]})" >&2; exit 1; }
  done
  read -r -a binaries <<<"$NODE_ASSETS_ONLY"
fi

# A binary is rebuilt when its module's go.mod/go.sum or its build flags changed since it was
# built (a stamp next to it records them); binaries without a stamp (put there by hand) are used
# as they are.
stamp_of() { { cat "$here/${module[$1]}/go.mod" "$here/${module[$1]}/go.sum"; echo "${tags[$1]:-} ${ldflags[$1]}"; } | sha256sum | cut -c1-16; }
stamp_file() { echo "$bin_dir/$(dirname "$1")/.$(basename "$1").stamp"; }
missing=()
for b in "${binaries[@]}"; do
  sf=$(stamp_file "$b")
  if [[ ! -x $bin_dir/$b ]] || { [[ -f $sf ]] && [[ $(<"$sf") != $(stamp_of "$b") ]]; }; then
    missing+=("$b")
  fi
done

# The Prometheus operator's CRDs: the files of its module as go.sum pins it (no build).
operator_version=$(mod_version "$here/prometheus-operator" github.com/prometheus-operator/prometheus-operator)
operator_crds=(podmonitors servicemonitors prometheusrules)
operator_stamp=$(cat "$here/prometheus-operator/go.mod" "$here/prometheus-operator/go.sum" | sha256sum | cut -c1-16)
if [[ -z ${NODE_ASSETS_ONLY:-} ]] && [[ ! -f $bin_dir/crds/.stamp || $(<"$bin_dir/crds/.stamp") != "$operator_stamp" ]]; then
  if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
    export PATH="$PATH:/usr/local/go/bin"
  fi
  command -v go >/dev/null 2>&1 || { echo "node-assets: Go is not installed (it downloads the Prometheus operator's CRDs)" >&2; exit 1; }
  echo "node-assets: the Prometheus operator's CRDs ($operator_version)"
  dir=$( (cd "$here/prometheus-operator" && GOFLAGS=-mod=mod timeout 900 go mod download -json \
    github.com/prometheus-operator/prometheus-operator) | awk -F'"' '$2 == "Dir" { print $4 }')
  [[ -n $dir ]] || { echo "node-assets: downloading github.com/prometheus-operator/prometheus-operator failed" >&2; exit 1; }
  mkdir -p "$bin_dir/crds"
  for crd in "${operator_crds[@]}"; do
    install -m 0644 "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$crd.yaml" "$bin_dir/crds/"
  done
  echo "$operator_stamp" >"$bin_dir/crds/.stamp"
fi
if ! command -v runc >/dev/null 2>&1; then
  echo "node-assets: warning: runc is not installed (apt-get install runc); containerd cannot start containers without it" >&2
fi
if ((${#missing[@]} == 0)); then
  echo "node-assets: kubelet $kube_version, containerd $containerd_version, CNI plugins $cni_version, helm $helm_version are up to date in:"
  echo "$bin_dir"
  exit 0
fi

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="$PATH:/usr/local/go/bin"
fi
if ! command -v go >/dev/null 2>&1; then
  echo "node-assets: Go is not installed (need it on PATH to build ${missing[*]})." >&2
  echo "node-assets: install Go from https://go.dev/dl or your distribution, or point NETAGENT_NODE_ASSETS at prebuilt binaries." >&2
  exit 1
fi
go_version=$(go env GOVERSION | sed 's/^go//')
for b in "${missing[@]}"; do
  required_go=$(awk '$1 == "go" { print $2; exit }' "$here/${module[$b]}/go.mod")
  if [[ $(printf '%s\n%s\n' "$required_go" "$go_version" | sort -V | head -n1) != "$required_go" ]]; then
    echo "node-assets: Go $go_version is too old: $b needs go >= $required_go ($(command -v go))." >&2
    exit 1
  fi
done

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod -buildvcs=false"
mkdir -p "$bin_dir/cni"
log_dir="$(dirname "$bin_dir")/logs"
mkdir -p "$log_dir"

downloaded=""
for b in "${missing[@]}"; do
  dir="$here/${module[$b]}"
  log="$log_dir/${b//\//-}.build.log"
  echo "node-assets: building $b (${package[$b]}), log: $log"
  start=$SECONDS
  : >"$log"
  # Download first with a bound so an unreachable module proxy is reported as such.
  if [[ " $downloaded " != *" ${module[$b]} "* ]]; then
    if ! (cd "$dir" && timeout 900 go mod download) >>"$log" 2>&1; then
      echo "node-assets: downloading the Go modules for $b failed; is the module proxy (GOPROXY=$(go env GOPROXY)) reachable?" >&2
      tail -n 5 "$log" >&2
      echo "node-assets: full log: $log" >&2
      exit 1
    fi
    downloaded+=" ${module[$b]}"
  fi
  if ! (cd "$dir" && go build -trimpath -tags "${tags[$b]:-}" -ldflags "${ldflags[$b]}" -o "$bin_dir/$b.tmp" "${package[$b]}") >>"$log" 2>&1; then
    rm -f "$bin_dir/$b.tmp"
    echo "node-assets: building $b failed:" >&2
    tail -n 20 "$log" >&2
    echo "node-assets: full log: $log" >&2
    exit 1
  fi
  mv "$bin_dir/$b.tmp" "$bin_dir/$b"
  stamp_of "$b" >"$(stamp_file "$b")"
  echo "node-assets: built $b in $((SECONDS - start)) s ($(du -h "$bin_dir/$b" | cut -f1))"
done
echo "node-assets: kubelet $kube_version, containerd $containerd_version, CNI plugins $cni_version, helm $helm_version are in:"
echo "$bin_dir"
