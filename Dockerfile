# syntax=docker/dockerfile:1
# One image for both parts: `netagent run` (the agent DaemonSet) and `netagent controller`.
#   docker build -t netagent:0.1.0 .          # on the pinned base below
# Without a Docker engine or a registry: hack/image/build.sh (buildah, and a base image built
# from Debian's packages, passed as BASE by its digest); `make release` (docs/release.md) adds
# the stamped version and revision, an SBOM and the packaged chart.
# The agent needs the userspace tools it drives: iptables (both the nft and the legacy
# backends; the agent picks the node's), ipset, and iproute2 (tc, for debugging on the node).
# The image carries the product only: no lab, no demo, no matplotlib (pyproject's packages).
# Python dependencies come from the lock files, every file checked against its hash
# (hack/image/lock.sh writes them).
#
# Four stages: `build` makes netagent's wheel, `app` installs it and the locked dependencies into
# a virtual environment (/opt/netagent), `os` is the base with the node tools and without pip,
# apt and dpkg, and the runtime is `os` and `app` copied onto scratch: no layer of it holds a
# package manager or a compiler of wheels, and every module is bytecode compiled (the runtime
# user cannot write __pycache__, so an image without .pyc compiled every import at every start).

# The base of every stage: a Debian with Python 3.11, pip and apt, pinned by digest so a build
# gets exactly the image reviewed (a tag moves; a digest names content). Never edit the pin by
# hand: hack/image/update-base-digest.sh resolves the tag's current digest and rewrites this line.
# hack/image/build.sh passes its own locally built base, by digest too.
ARG BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${BASE} AS build
WORKDIR /src
COPY requirements-build.lock ./
RUN pip install --no-cache-dir --require-hashes --no-deps -r requirements-build.lock
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY netagent ./netagent
COPY controller ./controller
COPY core ./core
COPY tc ./tc
COPY iptables ./iptables
COPY nlwire ./nlwire
# what `netagent --version` prints in the image: the stamp hack/release/stamp.py gives (the
# version with its git position, -dirty for a dirty tree) and the full revision; none without them
ARG VERSION=""
ARG REVISION=""
RUN rm -f netagent/_build.py \
    && if [ -n "$REVISION" ]; then \
         printf '"""Written by the image build (Dockerfile): netagent --version."""\nVERSION = "%s"\nREVISION = "%s"\n' \
           "$VERSION" "$REVISION" >netagent/_build.py; \
       fi \
    && pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${BASE} AS app
# a virtual environment: the dependencies never mix with the base's Python packages (the base's
# pip installs into it from outside, with --python, and stays behind in this stage)
RUN python3 -m venv --without-pip /opt/netagent
COPY requirements.lock /tmp/requirements.lock
RUN pip --python /opt/netagent/bin/python install --no-cache-dir --no-compile --require-hashes --no-deps \
      -r /tmp/requirements.lock \
    && rm /tmp/requirements.lock
# netagent's own wheel (its dependencies are installed above). Copied, not bind-mounted from the
# build stage: buildah's layer cache does not look into a RUN's bind mounts, so a changed wheel
# behind `RUN --mount=from=build` reused the old layer (a stale image); the copy is keyed by
# its content, and weighs as much as the wheel (about 0.3 MB)
COPY --from=build /wheels /tmp/wheels
# bytecode for every module, checked by nothing at import (unchecked-hash: the image's files never
# change under it, and copying between stages may not keep the sources' mtimes)
RUN pip --python /opt/netagent/bin/python install --no-cache-dir --no-compile --no-deps --no-index /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && /opt/netagent/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash /opt/netagent/lib

FROM ${BASE} AS os
# Debian's security updates land under the same package names: pinning versions would only
# make the build fail when the mirror drops the pinned one. apt verifies every package against
# the archive's signed Release file. `apt-get clean`: a base built by debootstrap has no
# docker-clean hook, so the downloaded .debs (80 MB) would stay in the layer.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends iptables ipset iproute2 \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*
# Then pip, apt and dpkg go: Debian's pip packages by apt, a pip installed by pip (the python
# image's) by itself, apt and dpkg by dpkg (forced: they are essential to a system that installs
# packages, which the runtime never does). /var/lib/dpkg/status stays, with what is installed, for
# SBOM tools and scanners; the alternatives' links (iptables -> xtables-nft-multi) stay.
# The standard library is compiled as the venv is (the base keeps no bytecode).
RUN for p in python3-pip python3-setuptools python3-wheel; do \
      if dpkg -s "$p" >/dev/null 2>&1; then apt-get purge -y -q --auto-remove "$p" >/dev/null; fi; \
    done \
    && if python3 -m pip --version >/dev/null 2>&1; then python3 -m pip uninstall -y -q pip setuptools wheel; fi \
    && dpkg --purge --force-remove-essential --force-depends apt >/dev/null \
    && dpkg --purge --force-remove-essential --force-depends dpkg >/dev/null \
    && rm -rf /var/lib/dpkg/status-old /var/lib/dpkg/available /var/lib/dpkg/info /var/lib/dpkg/triggers \
      /var/lib/dpkg/lock* /var/log/apt /var/cache/apt /var/lib/apt /etc/apt /etc/dpkg /var/cache/debconf/*-old \
    && python3 -m compileall -q -j 0 --invalidation-mode unchecked-hash \
      "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"

FROM scratch
# the whole of `os` on purpose: one layer without the package managers the base's layers hold
# hadolint ignore=DL3067
COPY --from=os / /
COPY --from=app /opt/netagent /opt/netagent
ENV PATH=/opt/netagent/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# non-root by default (the controller); the agent's DaemonSet sets uid 0 with only
# NET_ADMIN and NET_RAW, which Linux grants only to uid 0 without ambient capabilities
USER 65532:65532
EXPOSE 9560 9561
ENTRYPOINT ["netagent"]
CMD ["--help"]
# OCI labels, last (a new revision or date changes no layer): hack/image/build.sh passes them
ARG VERSION=""
ARG REVISION=""
ARG CREATED=""
ARG SOURCE="https://netagent.io"
LABEL org.opencontainers.image.title="netagent" \
      org.opencontainers.image.description="Kubernetes internet egress control: the per-node agent and the controller" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0"
