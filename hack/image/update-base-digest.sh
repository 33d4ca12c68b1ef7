#!/usr/bin/env bash
# Re-pin the Dockerfile's base image: resolve the current digest of its tag and rewrite the
# `ARG BASE=name:tag@sha256:...` line. The pin is never edited by hand.
#
#   hack/image/update-base-digest.sh                  # the pinned tag's current digest
#   hack/image/update-base-digest.sh python:3.11-slim-bookworm   # another tag
#   hack/image/update-base-digest.sh --check          # exit 1 when the pin is not the tag's digest
#
# Options:
#   --dockerfile FILE   the Dockerfile to rewrite (default: the repository's)
#   --resolver NAME     skopeo, crane or buildah (default: the first installed, in that order).
#                       skopeo and crane read the registry and pin the tag's top-level manifest
#                       (the multi-arch index: every platform pulls through one pin); buildah pulls
#                       the image (unless it is local, e.g. localhost/netagent-base:bookworm) and
#                       pins the manifest it stores, one platform's.
#   --check             compare only; change nothing
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dockerfile="$repo/Dockerfile"
resolver=""
check=0
ref=""
while (($#)); do
  case $1 in
    --dockerfile) dockerfile=${2:?--dockerfile needs a file}; shift 2 ;;
    --resolver) resolver=${2:?--resolver needs skopeo, crane or buildah}; shift 2 ;;
    --check) check=1; shift ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "update-base-digest: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [[ -z $ref ]] || { echo "update-base-digest: one image reference at most" >&2; exit 2; }
       ref=$1; shift ;;
  esac
done

die() { echo "update-base-digest: $*" >&2; exit 1; }

[[ -f $dockerfile ]] || die "no Dockerfile at $dockerfile"
count=$(grep -c '^ARG BASE=' "$dockerfile" || true)
[[ $count == 1 ]] || die "$dockerfile must have exactly one 'ARG BASE=' line (found $count)"
current=$(sed -n 's/^ARG BASE=//p' "$dockerfile")
# the tag to resolve: the one given, else the pinned one (its digest dropped)
ref=${ref:-${current%@*}}
[[ $ref != *@* ]] || die "give a tag to resolve (name:tag), not a digest: $ref"
[[ $ref =~ ^[a-z0-9][a-z0-9._/:-]*$ ]] || die "not an image reference: $ref"

if [[ -z $resolver ]]; then
  for tool in skopeo crane buildah; do
    if command -v "$tool" >/dev/null 2>&1; then resolver=$tool; break; fi
  done
  [[ -n $resolver ]] || die "needs skopeo, crane or buildah to resolve $ref"
fi
command -v "$resolver" >/dev/null 2>&1 || die "$resolver is not installed"

case $resolver in
  skopeo)
    # the digest of the manifest exactly as the registry serves it (an index for multi-arch tags)
    digest="sha256:$(skopeo inspect --raw "docker://$ref" | sha256sum | cut -d' ' -f1)" ;;
  crane)
    digest=$(crane digest "$ref") ;;
  buildah)
    if ! buildah inspect --type image "$ref" >/dev/null 2>&1; then
      buildah pull --quiet "$ref" >/dev/null || die "buildah cannot pull $ref"
    fi
    # what hack/image/build.sh pins its local base by
    digest=$(buildah inspect --type image --format '{{.FromImageDigest}}' "$ref") ;;
  *) die "unknown resolver $resolver (skopeo, crane or buildah)" ;;
esac
[[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || die "$resolver gave no digest for $ref (got '$digest')"

pinned="$ref@$digest"
if [[ $pinned == "$current" ]]; then
  echo "update-base-digest: BASE is $pinned (current)"
  exit 0
fi
if ((check)); then
  echo "update-base-digest: BASE is $current, but $ref is now $digest: run hack/image/update-base-digest.sh" >&2
  exit 1
fi
# rewrite the one line in place, through a temporary file beside it (an interrupted run leaves
# the Dockerfile as it was)
tmp=$(mktemp "$dockerfile.XXXXXX")
trap 'rm -f "$tmp"' EXIT
awk -v line="ARG BASE=$pinned" '/^ARG BASE=/ { print line; next } { print }' "$dockerfile" >"$tmp"
chmod --reference="$dockerfile" "$tmp"
mv "$tmp" "$dockerfile"
trap - EXIT
echo "update-base-digest: BASE $current -> $pinned"
