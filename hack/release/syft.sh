#!/usr/bin/env bash
# Build syft (the SBOM tool `make release` runs) from its Go module into the machine-level cache,
# as hack/node-assets/build.sh builds helm: once, then reused. Prints the binary's path.
#
#   ${XDG_CACHE_HOME:-$HOME/.cache}/netagent/release-assets/syft-<version>/bin/syft
#
# Environment:
#   SYFT_VERSION   the module version (default below)
#   GOPROXY, GOMODCACHE, GOCACHE  the usual Go settings
# CI does not run this (a cold build takes minutes); tests/test_release.py's SBOM test runs where
# the binary exists.
set -euo pipefail
version="${SYFT_VERSION:-v1.57.1}"
[[ $version =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "syft: SYFT_VERSION must be vX.Y.Z, not '$version'" >&2; exit 2; }
bin_dir="${XDG_CACHE_HOME:-$HOME/.cache}/netagent/release-assets/syft-$version/bin"
if [[ -x $bin_dir/syft ]]; then
  echo "$bin_dir/syft"
  exit 0
fi
command -v go >/dev/null 2>&1 || { echo "syft: needs Go (https://go.dev/dl/) to build github.com/anchore/syft $version" >&2; exit 1; }
mkdir -p "$bin_dir"
start=$SECONDS
echo "syft: go install github.com/anchore/syft/cmd/syft@$version (once; minutes)" >&2
# the version syft reports (and writes into every SBOM's creator field), as its release build sets it
GOBIN="$bin_dir" CGO_ENABLED=0 go install -trimpath \
  -ldflags "-s -w -X main.version=${version#v} -X main.gitCommit=module-proxy -X main.buildDate=1970-01-01T00:00:00Z -X main.gitDescription=$version" \
  "github.com/anchore/syft/cmd/syft@$version" >&2
echo "syft: built $bin_dir/syft in $((SECONDS - start)) s" >&2
echo "$bin_dir/syft"
