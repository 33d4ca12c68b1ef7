# syntax=docker/dockerfile:1
# One image for both parts: `netagent run` (the agent DaemonSet) and `netagent controller`.
#   docker build -t netagent:0.1.0 .          # on the pinned base below
# Without a Docker engine or a registry: hack/image/build.sh (buildah, and a base image built
# from Debian's packages, passed as BASE by its digest).
# The agent needs the userspace tools it drives: iptables (both the nft and the legacy
# backends; the agent picks the node's), ipset, and iproute2 (tc, for debugging on the node).
# The image carries the product only: no lab, no demo, no matplotlib (pyproject's packages).
# Python dependencies come from the lock files, every file checked against its hash
# (hack/image/lock.sh writes them).

# The base of both stages: a Debian with Python 3.11, pip and apt, pinned by digest so a build
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
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${BASE}
# Debian's security updates land under the same package names: pinning versions would only
# make the build fail when the mirror drops the pinned one. apt verifies every package against
# the archive's signed Release file. `apt-get clean`: a base built by debootstrap has no
# docker-clean hook, so the downloaded .debs (80 MB) would stay in the layer.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends iptables ipset iproute2 \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*
COPY requirements.lock /tmp/requirements.lock
RUN pip install --no-cache-dir --no-compile --require-hashes --no-deps -r /tmp/requirements.lock \
    && rm /tmp/requirements.lock
# netagent's own wheel (its dependencies are installed above). Copied, not bind-mounted from the
# build stage: buildah's layer cache does not look into a RUN's bind mounts, so a changed wheel
# behind `RUN --mount=from=build` reused the old layer (a stale image); the copy is keyed by
# its content, and weighs as much as the wheel (about 0.3 MB)
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-compile --no-deps --no-index /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# non-root by default (the controller); the agent's DaemonSet sets uid 0 with only
# NET_ADMIN and NET_RAW, which Linux grants only to uid 0 without ambient capabilities
USER 65532:65532
EXPOSE 9560 9561
ENTRYPOINT ["netagent"]
CMD ["--help"]
