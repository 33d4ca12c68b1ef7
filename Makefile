# Kubernetes test assets for tests/kube.py: built from Go modules into a machine-level cache
# (${XDG_CACHE_HOME:-$HOME/.cache}/netagent/kube-assets/<version>/bin, or NETAGENT_KUBE_ASSETS).
# Only missing binaries are built; a second run is instant.
.PHONY: kube-assets
kube-assets:
	@bash hack/kube-assets/build.sh
