#!/usr/bin/env bash
# Build the netagent image from the repository's Dockerfile with buildah (no Docker engine needed),
# on a base image built here from Debian's packages, so no container registry is needed either.
#
#   hack/image/build.sh                 # base (once) + localhost/netagent:<version>
#   hack/image/build.sh --archive FILE  # also write the image as an OCI archive (ctr images import)
#
# The base, localhost/netagent-base:<suite>, is what the Dockerfile's pinned default base
# (python:3.11-slim-bookworm) offers it: Debian <suite> (bookworm: Python 3.11) from debootstrap
# --variant=minbase with python3, pip and apt, `python` and `pip` on PATH, and pip allowed to
# install into the system Python (PIP_BREAK_SYSTEM_PACKAGES=1, as a slim image's pip may). It is
# built once and reused; NETAGENT_REBUILD_BASE=1 rebuilds it. The Dockerfile's RUN steps use the
# host's network (apt-get from Debian, pip from PyPI).
#
# Environment:
#   NETAGENT_IMAGE        image name (default localhost/netagent:<netagent.__version__>)
#   NETAGENT_SOURCE_URL   the org.opencontainers.image.source label (default https://github.com/netagent/netagent, where the chart's runbook links point too)
#   NETAGENT_BASE_IMAGE   use this base instead of building one, pinned by digest (e.g.
#                         python:3.11-slim-bookworm@sha256:<digest> where a registry is reachable)
#   DEBIAN_SUITE, DEBIAN_MIRROR  what debootstrap installs from (bookworm, http://deb.debian.org/debian)
#   NETAGENT_BUILD_CA_BUNDLE  CA bundle the RUN steps trust (default: the host's
#                         /etc/ssl/certs/ca-certificates.crt, mounted read-only, not copied in)
# Needs root, buildah and debootstrap (apt-get install buildah debootstrap).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"

archive=""
while (($#)); do
  case $1 in
    --archive) archive=${2:?--archive needs a file}; shift 2 ;;
    -h | --help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "image: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

for tool in buildah debootstrap; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "image: $tool is not installed (apt-get install buildah debootstrap)" >&2
    exit 1
  fi
done
if [[ $(id -u) -ne 0 ]]; then
  echo "image: run as root (debootstrap and buildah's storage)" >&2
  exit 1
fi

# buildah's network library leaves /etc/cni/net.d/cni.lock behind even with --network=host
if [[ ! -e /etc/cni ]]; then
  trap 'rm -f /etc/cni/net.d/cni.lock; rmdir /etc/cni/net.d /etc/cni 2>/dev/null || true' EXIT
fi

# The stamp (hack/release/stamp.py): netagent.__version__ and the tree's place in git, `-dirty` when
# it has uncommitted changes; the image's version label and `netagent --version` carry it
read -r stamped revision tree created < <(python3 "$repo/hack/release/stamp.py" --repo "$repo") \
  || { echo "image: cannot stamp a version (hack/release/stamp.py)" >&2; exit 1; }
version=${stamped%%-*}
image="${NETAGENT_IMAGE:-localhost/netagent:$version}"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
base="${NETAGENT_BASE_IMAGE:-localhost/netagent-base:$suite}"

image_size() { buildah inspect --type image --format '{{.FromImageID}}' "$1" >/dev/null 2>&1 && buildah images --format '{{.Size}}' "$1" | head -n1; }

build_base() {
  local rootfs ctr start=$SECONDS
  rootfs=$(mktemp -d /tmp/netagent-base-rootfs.XXXXXX)
  ctr=""
  # shellcheck disable=SC2064
  trap "rm -rf '$rootfs' '$rootfs.tar'; [[ -z \$ctr ]] || buildah rm \$ctr >/dev/null 2>&1 || true" RETURN
  echo "image: debootstrap $suite (minbase + python3, pip) from $mirror"
  local log="$rootfs.log"
  if ! debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
    "$suite" "$rootfs" "$mirror" >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "image: debootstrap failed; full log: $log" >&2
    exit 1
  fi
  rm -f "$log"
  # apt inside the image: the suite's updates and security archives too, as Debian's images have
  cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb ${mirror%/debian}/debian-security $suite-security main
EOF
  # what a slim image leaves out: package caches, lists, docs, man pages, locales, logs
  rm -rf "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log \
    "$rootfs"/var/log/apt/* "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C.*' -exec rm -rf {} +
  find "$rootfs/usr/lib" -name __pycache__ -type d -prune -exec rm -rf {} +
  # keep docs and man pages out of later apt installs too, as Debian's slim images do
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/netagent-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
EOF
  ctr=$(buildah from scratch)
  tar -C "$rootfs" --numeric-owner -cf "$rootfs.tar" .
  buildah add "$ctr" "$rootfs.tar" / >/dev/null
  rm -f "$rootfs.tar"
  buildah config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --env PIP_BREAK_SYSTEM_PACKAGES=1 \
    --env PIP_DISABLE_PIP_VERSION_CHECK=1 \
    --cmd python3 \
    --label "org.opencontainers.image.description=Debian $suite minbase with python3 and pip, built by netagent's hack/image/build.sh" \
    "$ctr"
  buildah commit --quiet --rm "$ctr" "$base" >/dev/null
  ctr=""
  echo "image: built base $base in $((SECONDS - start)) s ($(image_size "$base"))"
}

if [[ -z ${NETAGENT_BASE_IMAGE:-} ]]; then
  if [[ ${NETAGENT_REBUILD_BASE:-} == 1 ]] || ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    build_base
  else
    echo "image: using base $base ($(image_size "$base"); NETAGENT_REBUILD_BASE=1 rebuilds it)"
  fi
fi

# The base by digest, so the build uses exactly the image checked (or built) here. The local base
# is built from Debian's packages as the suite has them today: debootstrap verifies each package
# against the suite's signed Release file (versions are the suite's current ones, security updates
# included; `buildah run` of the base with `dpkg-query -W` lists them).
if [[ -n ${NETAGENT_BASE_IMAGE:-} ]]; then
  [[ $base == *@sha256:* ]] || { echo "image: NETAGENT_BASE_IMAGE must be pinned by digest (name@sha256:...)" >&2; exit 1; }
  pinned=$base
else
  pinned="$base@$(buildah inspect --type image --format '{{.FromImageDigest}}' "$base")"
fi

start=$SECONDS
echo "image: buildah build $image from Dockerfile on $pinned"
echo "image: version $stamped, revision $revision, tree $tree"
# The RUN steps trust the host's CA bundle (so a TLS-intercepting proxy's CA is trusted too): it is
# mounted for the build, never copied into the image.
ca_bundle="${NETAGENT_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
ca_mount=()
[[ -f $ca_bundle ]] && ca_mount=(--volume "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")
# the labels' values (the Dockerfile's last ARGs: only the labels change with them)
labels=(--build-arg "VERSION=$stamped" --build-arg "REVISION=$revision"
  --build-arg "CREATED=$created" --build-arg "SOURCE=${NETAGENT_SOURCE_URL:-https://github.com/netagent/netagent}")
buildah build --quiet --layers --force-rm --network=host "${ca_mount[@]}" --build-arg "BASE=$pinned" "${labels[@]}" \
  -t "$image" -f "$repo/Dockerfile" "$repo" >/dev/null
echo "image: built $image in $((SECONDS - start)) s ($(image_size "$image"))"
if [[ -n $archive ]]; then
  rm -f "$archive"
  buildah push --quiet "$image" "oci-archive:$archive:$image"
  echo "image: wrote $archive ($(du -h "$archive" | cut -f1))"
fi
echo "$image"
