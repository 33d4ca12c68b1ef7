"""netagent: Kubernetes internet egress control (the per-node agent lives here)."""

# The one version: pyproject.toml reads it (setuptools' dynamic version), the chart's version and
# appVersion and the image's labels carry it (tests/test_release.py). Bump it here only.
__version__ = "0.1.0"


def build_info() -> dict[str, str]:
    """What an image build stamped (netagent/_build.py, written by the Dockerfile's build stage
    from hack/release/stamp.py): the version with its git position (`0.1.0`, `0.1.0-dev.77.g0813e79`,
    `-dirty` when the tree had uncommitted changes) and the full revision. A source tree has none."""
    try:
        from netagent import _build  # type: ignore[attr-defined]  # generated; absent in a checkout
    except ImportError:
        return {"version": __version__, "revision": ""}
    return {"version": _build.VERSION, "revision": _build.REVISION}


def version_line() -> str:
    """`netagent --version`."""
    info = build_info()
    if not info["revision"]:
        return f"netagent {__version__} (no build stamp: a source tree, or an image built without hack/image/build.sh)"
    return f"netagent {info['version']} (revision {info['revision']})"
