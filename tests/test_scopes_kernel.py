"""The scopes' LPM tries in the real kernel (issue 39 foundations): created, loaded from
core.scopes.lpm_entries, updated in place by diff_entries, looked up with longest-prefix semantics
through the map lookup syscall, and agreeing with the userspace reference scope_of. No traffic."""
import ipaddress
import os

import pytest

from core.scopes import SCOPE_IDS, Scope, diff_entries, lpm_entries, parse, scope_of
from tc.ebpf.maps import SCOPE_MAP_NAMES, create_map, scope_apply, scope_lookup, scope_map_shape

from tests.test_scopes import EXAMPLE, spec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bpf(2) needs root")

ADDRESSES = ["10.0.1.1", "10.0.65.1", "10.0.80.1", "10.0.100.1", "10.1.2.3", "172.16.3.4", "192.0.2.1",
             "2001:db8:a::1", "2001:db8:b::1"]


@pytest.fixture
def tries():
    fds = {v: create_map(scope_map_shape(v, 64), SCOPE_MAP_NAMES[v]) for v in (4, 6)}
    yield fds
    for fd in fds.values():
        os.close(fd)


def _agrees(fds, desc, zone):
    for a in ADDRESSES:
        sid = scope_lookup(fds, a)
        kernel = Scope.INTERNET if sid is None else next(s for s, i in SCOPE_IDS.items() if i == sid)
        assert kernel is scope_of(desc, a, zone), a


def test_lpm_trie_loaded_updated_in_place_and_looked_up(tries):
    d1 = parse(EXAMPLE, pod_cidrs=["172.16.0.0/16"]).description
    assert d1 is not None
    e1 = lpm_entries(d1, "us-east-1a")
    scope_apply(tries, *diff_entries({}, e1))
    _agrees(tries, d1, "us-east-1a")
    # a CIDR moved between zones: only the difference is written, the same maps (fds) stay
    moved = spec(zones=[{"name": "us-east-1a", "cidrs": ["10.0.0.0/18", "10.0.96.0/19", "2001:db8:a::/48"]},
                        {"name": "us-east-1b", "cidrs": ["10.0.64.0/19"]}])
    d2 = parse(moved, pod_cidrs=["172.16.0.0/16"]).description
    assert d2 is not None
    scope_apply(tries, *diff_entries(e1, lpm_entries(d2, "us-east-1a")))
    _agrees(tries, d2, "us-east-1a")
    assert scope_lookup(tries, "10.0.100.1") == SCOPE_IDS[Scope.INTERNAL]
    assert scope_lookup(tries, "10.0.80.1") == SCOPE_IDS[Scope.CROSS_ZONE]
    # longest prefix: a /24 inside a region's /16 overrides it in the trie
    scope_apply(tries, {ipaddress.ip_network("10.1.2.0/24"): SCOPE_IDS[Scope.INTERNAL]}, [])
    assert scope_lookup(tries, "10.1.2.3") == SCOPE_IDS[Scope.INTERNAL]
    assert scope_lookup(tries, "10.1.3.3") == SCOPE_IDS[Scope.CROSS_REGION]


def test_the_lookup_cost_bench_loads_and_runs_its_programs(tries):
    """bench/scope_lookup_cost's program passes the verifier with the trie and runs (no timing asserted)."""
    from bench.scope_lookup_cost import per_run_ns, program
    ip = bytes([10, 0, 1, 1])
    assert per_run_ns(program(None, ip), 10) >= 0
    assert per_run_ns(program(tries[4], ip), 10) >= 0
