# syntax=docker/dockerfile:1
# One image for both parts: `netagent run` (the agent DaemonSet) and `netagent controller`.
#   docker build -t netagent:0.1.0 .
# Without a Docker engine or a registry: hack/image/build.sh (buildah, and a base image built
# from Debian's packages, passed as BASE).
# The agent needs the userspace tools it drives: iptables (both the nft and the legacy
# backends; the agent picks the node's), ipset, and iproute2 (tc, for debugging on the node).
# The image carries the product only: no lab, no demo, no matplotlib (pyproject's packages).

# The base of both stages: a Debian with Python 3.11, pip and apt.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY netagent ./netagent
COPY controller ./controller
COPY core ./core
COPY tc ./tc
COPY iptables ./iptables
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${BASE}
# Debian's security updates land under the same package names: pinning versions would only
# make the build fail when the mirror drops the pinned one.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends iptables ipset iproute2 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-compile /wheels/*.whl \
    && rm -rf /wheels
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# non-root by default (the controller); the agent's DaemonSet sets uid 0 with only
# NET_ADMIN and NET_RAW, which Linux grants only to uid 0 without ambient capabilities
USER 65532:65532
EXPOSE 9560 9561
ENTRYPOINT ["netagent"]
CMD ["--help"]
