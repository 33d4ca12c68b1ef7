"""netagent: Kubernetes internet egress control (the per-node agent lives here)."""

__version__ = "0.1.0"
