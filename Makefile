# Kubernetes test assets for lab/kube.py (tests/kube.py, bench/scale.py): built from Go modules into a machine-level cache
# (${XDG_CACHE_HOME:-$HOME/.cache}/netagent/kube-assets/<version>/bin, or NETAGENT_KUBE_ASSETS).
# Only missing binaries are built; a second run is instant.
.PHONY: kube-assets
kube-assets:
	@bash hack/kube-assets/build.sh

# Real-node assets for tests/node/: kubelet (the release of kube-assets), containerd with its runc
# shim and ctr, the CNI plugins (ptp, bridge, host-local, loopback, portmap, bandwidth) and helm,
# built from Go modules into ${XDG_CACHE_HOME:-$HOME/.cache}/netagent/node-assets/<version>/bin
# (or NETAGENT_NODE_ASSETS). runc, buildah and busybox-static come from Debian.
.PHONY: node-assets
node-assets:
	@bash hack/node-assets/build.sh

# The netagent image (tests/test_install.py builds it too, the way users do): hack/image/build.sh
# with buildah, on a base built once from Debian's packages (localhost/netagent-base:bookworm in
# buildah's storage) and buildah's layer cache; an unchanged tree rebuilds in seconds.
.PHONY: image
image:
	@bash hack/image/build.sh

# A release into out/release/ (docs/release.md): the image stamped with the version from git
# (-dirty for a dirty tree), its OCI archive and SBOM (syft, built once like the assets above), and
# the chart packaged for an OCI registry. `make release CHART_ONLY=1`: the chart alone.
.PHONY: release
release:
	@bash hack/release/release.sh $(if $(CHART_ONLY),--chart-only)
