#!/usr/bin/env bash
# `make release`: the image, its SBOM and the chart, all stamped with one version, into out/release/
# (docs/release.md has the push commands).
#
#   hack/release/release.sh [--out DIR] [--chart-only]
#
# 1. the stamp (hack/release/stamp.py): netagent.__version__ and the tree's place in git; a dirty
#    tree's stamp ends in -dirty, and this script says so
# 2. the image (hack/image/build.sh) tagged $NETAGENT_RELEASE_REPOSITORY:<stamp>, labelled with
#    org.opencontainers.image.{version,revision,created,source,licenses}, and written as an OCI
#    archive, netagent-<stamp>.oci.tar
# 3. its SBOM by syft (SPDX 2.3 JSON), netagent-<stamp>.spdx.json: every Debian package and Python
#    distribution in the image (hack/release/syft.sh builds syft once; SYFT=path uses another)
# 4. the chart, `helm package` with version and appVersion set to the stamp, netagent-<stamp>.tgz:
#    what `helm push ... oci://` takes
# 5. SHA256SUMS of the three
# --chart-only: steps 1 and 4 only (no root, buildah or syft needed).
#
# Environment:
#   NETAGENT_RELEASE_REPOSITORY  the image's repository (default localhost/netagent); the tag is the stamp
#   NETAGENT_HELM                helm to use (default: on PATH, else the one `make node-assets` builds)
#   SYFT                         syft to use (default: hack/release/syft.sh's)
#   NETAGENT_SOURCE_URL          the image's source label (hack/image/build.sh)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="$repo/out/release"
chart_only=0
while (($#)); do
  case $1 in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --chart-only) chart_only=1; shift ;;
    -h | --help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "release: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "release: $*" >&2; exit 1; }

read -r stamped revision tree created < <(python3 "$repo/hack/release/stamp.py" --repo "$repo") \
  || die "cannot stamp a version (hack/release/stamp.py)"
echo "release: version $stamped (revision $revision, $created)"
case $tree in
  dirty) echo "release: the tree has uncommitted changes: the version says so (-dirty); commit for a clean release" >&2 ;;
  unknown) echo "release: not a git checkout: no revision, the version says so (-unknown)" >&2 ;;
esac

helm=${NETAGENT_HELM:-$(command -v helm || true)}
if [[ -z $helm ]]; then
  kube_version=$(awk '$1 == "k8s.io/kubernetes" { print $2; exit }' "$repo/hack/kube-assets/go.mod")
  helm="${XDG_CACHE_HOME:-$HOME/.cache}/netagent/node-assets/$kube_version/bin/helm"
fi
[[ -x $helm ]] || die "no helm (make node-assets builds one; NETAGENT_HELM=path uses another)"
mkdir -p "$out"
out=$(cd "$out" && pwd)
artifacts=()

if ((!chart_only)); then
  syft=${SYFT:-$(bash "$repo/hack/release/syft.sh")} || die "no syft (hack/release/syft.sh builds it from its Go module)"
  [[ -x $syft ]] || die "syft is not executable: $syft"
  image="${NETAGENT_RELEASE_REPOSITORY:-localhost/netagent}:$stamped"
  archive="$out/netagent-$stamped.oci.tar"
  NETAGENT_IMAGE=$image bash "$repo/hack/image/build.sh" --archive "$archive" >&2
  artifacts+=("netagent-$stamped.oci.tar")
  sbom="$out/netagent-$stamped.spdx.json"
  # the archive, not the storage: what is pushed is what is described
  SYFT_CHECK_FOR_APP_UPDATE=false "$syft" scan --quiet "oci-archive:$archive" --source-name netagent \
    --source-version "$stamped" -o "spdx-json=$sbom" || die "syft could not scan $archive"
  artifacts+=("netagent-$stamped.spdx.json")
fi

rm -f "$out/netagent-$stamped.tgz"
# (helm notes each dashboard file the chart links to dashboards/ at INFO: not news)
"$helm" package "$repo/charts/netagent" --version "$stamped" --app-version "$stamped" -d "$out" >/dev/null \
  2> >(grep -v 'found symbolic link in path' >&2) || die "helm package failed"
artifacts+=("netagent-$stamped.tgz")
(cd "$out" && sha256sum "${artifacts[@]}" >SHA256SUMS)

echo "release: in $out:"
(cd "$out" && ls -l "${artifacts[@]}" SHA256SUMS | awk '{ printf "  %-48s %s bytes\n", $NF, $5 }')
if ((!chart_only)); then
  echo "release: image $image ($(buildah images --format '{{.Size}}' "$image" | head -n1)), labels:"
  buildah inspect --type image --format '{{range $k, $v := .Docker.Config.Labels}}  {{$k}}={{$v}}{{"\n"}}{{end}}' "$image" \
    | grep org.opencontainers
  python3 - "$sbom" <<'PY'
import collections, json, sys
doc = json.load(open(sys.argv[1]))
kinds = collections.Counter()
for p in doc.get("packages", []):
    for ref in p.get("externalRefs", []):
        if ref.get("referenceType") == "purl":
            kinds[ref["referenceLocator"].split("/")[0].removeprefix("pkg:")] += 1
print(f"release: SBOM {doc['spdxVersion']}, {len(doc.get('packages', []))} packages ({', '.join(f'{n} {k}' for k, n in kinds.most_common())})")
PY
fi
echo "release: push with the commands in docs/release.md"
