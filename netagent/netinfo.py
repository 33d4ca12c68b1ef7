"""Facts about this node's network that the agent learns instead of being told."""
from __future__ import annotations

import ipaddress

from pyroute2 import IPRoute


def default_route_devices() -> tuple[str, ...]:
    """Devices that carry a default route (IPv4 or IPv6): the node's uplinks."""
    names: list[str] = []
    with IPRoute() as ipr:
        for family in (2, 10):
            for r in ipr.get_default_routes(family=family):
                oifs = [r.get_attr("RTA_OIF")]
                mp = r.get_attr("RTA_MULTIPATH") or []
                oifs += [hop["oif"] for hop in mp]
                for oif in oifs:
                    if oif:
                        link = ipr.get_links(oif)[0]
                        name = link.get_attr("IFLA_IFNAME")
                        if name not in names:
                            names.append(name)
    return tuple(names)


def connected_networks(devices: tuple[str, ...]) -> tuple[str, ...]:
    """The subnets directly attached to the uplinks (the node's VPC subnet): internal by definition."""
    out: list[str] = []
    with IPRoute() as ipr:
        for dev in devices:
            idx = ipr.link_lookup(ifname=dev)
            if not idx:
                continue
            for a in ipr.get_addr(index=idx[0]):
                if a.get_attr("IFA_ADDRESS") is None or a["scope"] != 0:  # global scope only
                    continue
                net = ipaddress.ip_network(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}", strict=False)
                if net.prefixlen < net.max_prefixlen and str(net) not in out:
                    out.append(str(net))
    return tuple(out)
