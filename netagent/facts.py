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
    # the NetworkScopes description in force for this node's zone (issue 39): (CIDR, scope id) as the
    # counter's tries take them (core.scopes.lpm_entries); every one of them is internal, never shaped
    scopes: tuple[tuple[str, int], ...] = ()

    @property
    def internal(self) -> tuple[str, ...]:
        """Every internal network: the configured and connected ones, the cluster's service CIDRs and the
        CIDRs the NetworkScopes object describes."""
        if not self.service_cidrs and not self.scopes:
            return self.internal_cidrs
        return canonical_cidrs([*self.internal_cidrs, *self.service_cidrs, *(cidr for cidr, _ in self.scopes)])
