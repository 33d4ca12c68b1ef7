"""What the agent learns about its node while it runs, apart from its configuration.

`AgentConfig` is what the command line said and stays as it was built. The uplinks (followed from
the default routes when no --uplink was given) and the cluster's service CIDRs (from its
ServiceCIDR objects when no --service-cidr was given) change while the agent runs: they are a
`NodeFacts`, one immutable value the sync reads and the agent swaps whole when a fact changes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .desired import canonical_cidrs


@dataclass(frozen=True)
class NodeFacts:
    uplinks: tuple[str, ...]  # the node's internet-facing devices now
    internal_cidrs: tuple[str, ...]  # the configured and connected internal networks (AgentConfig's)
    service_cidrs: tuple[str, ...] = ()  # the cluster's, as its ServiceCIDR objects say now (when followed)

    @property
    def internal(self) -> tuple[str, ...]:
        """Every internal network: the configured and connected ones and the cluster's service CIDRs."""
        if not self.service_cidrs:
            return self.internal_cidrs
        return canonical_cidrs([*self.internal_cidrs, *self.service_cidrs])
