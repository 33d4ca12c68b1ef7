"""The agent's configuration: typed, validated, and discovered where the node can tell.

`AgentConfig` is what every part of the agent reads; `from_flags` builds it from the
command line's values (the CLI defines the flags, `cli/main.py`), checking everything it
can before anything touches the kernel and raising ConfigError naming the flag and the fix.
Its keywords are the flags' names (an edge: --ingress-* say downloads); inside, a value per
direction is a `PerDirection`.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field

from core.address import is_loopback, parse_host_port
from core.direction import PerDirection
from core.errors import ConfigError
from core.files import missing_paths
from core.quantity import parse_bps

from .desired import DesiredStateError, canonical_cidrs
from .netinfo import NetInfoError, connected_networks, default_route_devices
from .options import COUNTING_MODES, DataPathOptions
from .transport import PinnedCA, parse_endpoint

DEFAULT_LISTEN = "127.0.0.1:9560"
DEFAULT_STATE_LISTEN = "127.0.0.1:9562"  # /state (pod inventory) is served on loopback only
DEFAULT_TOKEN_PATH = "/var/run/secrets/netagent/token"


@dataclass(frozen=True)
class AgentConfig:
    """The agent's configuration, as built at start; what it learns while running is `facts.NodeFacts`."""
    node: str
    uplinks: tuple[str, ...]  # at start (named, or the default routes' devices then)
    internal_cidrs: tuple[str, ...]
    datapath: DataPathOptions = field(default_factory=DataPathOptions)
    controller: str | None = None  # base URL; None: single-node mode (local allocation)
    controller_ca: str | None = None  # the pinned CA of an https controller
    controller_insecure_http: bool = False  # tests only: plain http, and then no token is ever sent
    token_path: str | None = DEFAULT_TOKEN_PATH
    report_period: float = 5.0
    min_sync_interval: float = 0.05
    resync_seconds: float = 30.0
    sample_seconds: float = 1.0
    allocate_seconds: float = 2.0
    default_floor_bps: int = 1_000_000  # per pod when nothing better is known
    from_file: tuple[str, ...] = ()  # pods and policy from YAML files instead of Kubernetes
    kubeconfig: str | None = None  # None with no from_file: the in-cluster config
    listen: tuple[str, int] = ("127.0.0.1", 9560)  # /metrics /healthz /readyz (and /state when loopback)
    state_listen: tuple[str, int] | None = ("127.0.0.1", 9562)  # /state; None when --listen is loopback
    uplinks_learnt: bool = False  # no --uplink: the uplinks follow the default routes while running
    iptables_backend: str = "auto"
    shape_ingress: bool = True  # downloads (internet -> pod) shaped on the pods' devices
    # per direction, the node's rate with no controller answer (downloads: --ingress-rate); None: the
    # budget's total for it (single-node mode), else what the pods' rates add up to
    node_rate_bps: PerDirection[int | None] = PerDirection(None, None)
    lean_metrics: bool = False  # --lean-metrics: fewer per-pod series (netagent/metrics.py)
    internal_counting: str = "auto"  # --internal-counting: auto, device or rules (`choose_internal_counting`)
    services_known: bool = False  # the service CIDRs are internal: a ClusterIP is internal before DNAT too
    # no --service-cidr with Kubernetes: the cluster's ServiceCIDR objects say them, followed while running
    services_from_cluster: bool = False
    # --metrics-auth: /metrics needs a token allowed to get it (TokenReview + SubjectAccessReview), over TLS
    metrics_auth: bool = False
    # --state-dir: single-machine mode keeps its teams' quota use there (netagent.localquota)
    state_dir: str = "/var/lib/netagent"


def from_flags(*, node: str | None, from_file: list[str], kubeconfig: str | None, controller: str | None,
               token_path: str | None, uplink: list[str], internal_cidr: list[str], pod_cidr: list[str],
               service_cidr: list[str], listen: str, mark_bit: int, ifb: str, default_rate: str,
               report_period: float, resync_period: float, iptables_backend: str, controller_ca: str | None = None,
               controller_insecure_http: bool = False, state_listen: str = DEFAULT_STATE_LISTEN,
               ingress_rate: str | None = None, ingress_default_rate: str = "1M",
               ingress_ifb: str = DataPathOptions.ifbs.download, lean_metrics: bool = False,
               internal_counting: str = "auto", bpf_dir: str = DataPathOptions.bpf_dir,
               metrics_auth: str = "auto", state_dir: str = "/var/lib/netagent") -> AgentConfig:
    """The command line's values -> AgentConfig. Discovers the uplinks (default routes) when none
    is named and adds their connected subnets to the internal CIDRs. The leaf qdisc is the
    data path's choice after probing the kernel (`Daemon.build`)."""
    if from_file and kubeconfig:
        raise ConfigError("--from-file and --kubeconfig exclude each other: pods come from files or from Kubernetes")
    missing = missing_paths(list(from_file))
    if missing:  # a typo would start a node with no pods and its uplink programmed anyway
        raise ConfigError(f"--from-file {', '.join(missing)}: no such file or directory")
    node = node or (socket.gethostname() if from_file else "")
    if not node:
        raise ConfigError("--node is required with Kubernetes (set it from spec.nodeName via the downward API)")
    try:
        # per direction: the floor (--default-rate, --ingress-default-rate) and the node's rate (--ingress-rate)
        floors = PerDirection(parse_bps(default_rate, "--default-rate"),
                              parse_bps(ingress_default_rate, "--ingress-default-rate"))
        node_rates = PerDirection(None, parse_bps(ingress_rate, "--ingress-rate") if ingress_rate else None)
        for flag, value in (("--default-rate", floors.upload), ("--ingress-default-rate", floors.download),
                            ("--ingress-rate", node_rates.download)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag} must be a positive rate such as 1M")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    check_controller(controller, controller_ca, controller_insecure_http)
    listen_at = parse_host_port(listen, "--listen", DEFAULT_LISTEN)
    state_at = None if is_loopback(listen_at[0]) else parse_host_port(state_listen, "--state-listen",
                                                                       DEFAULT_STATE_LISTEN)
    if state_at is not None and not is_loopback(state_at[0]):
        raise ConfigError(f"--state-listen {state_listen} must be a loopback address (127.0.0.1 or ::1): "
                          "/state lists this node's pods and must not be reachable from them")
    auth = metrics_auth_wanted(metrics_auth, bool(from_file), listen_at[0])
    if ingress_ifb == ifb or not 1 <= len(ingress_ifb) <= 15:
        raise ConfigError(f"--ingress-ifb {ingress_ifb!r} must be a device name of 1..15 characters other than --ifb")
    if internal_counting not in COUNTING_MODES:
        raise ConfigError(f"--internal-counting {internal_counting!r}: choose {', '.join(COUNTING_MODES)}")
    if not bpf_dir.startswith("/") or len(bpf_dir) > 200 or "\0" in bpf_dir:
        raise ConfigError(f"--bpf-dir {bpf_dir!r} must be an absolute path of at most 200 characters")
    if not state_dir.startswith("/") or "\0" in state_dir:
        raise ConfigError(f"--state-dir {state_dir!r} must be an absolute path")
    if report_period <= 0 or resync_period <= 0:
        raise ConfigError("--report-period and --resync-period must be positive seconds")
    try:
        uplinks = tuple(uplink) or default_route_devices()
    except NetInfoError as exc:
        raise ConfigError(f"cannot find the uplink ({exc}): name it with --uplink DEV") from exc
    if not uplinks:
        raise ConfigError("no default route on this node, so the uplink is unknown: name it with --uplink DEV")
    for dev in uplinks:
        try:
            socket.if_nametoindex(dev)
        except OSError:
            raise ConfigError(f"uplink {dev!r} does not exist on this node: check --uplink "
                              f"(devices here: {', '.join(n for _, n in socket.if_nameindex())})") from None
    try:
        internal = canonical_cidrs([*internal_cidr, *pod_cidr, *service_cidr, *connected_networks(uplinks)])
    except (DesiredStateError, NetInfoError) as exc:
        raise ConfigError(str(exc)) from exc
    return AgentConfig(
        node=node, uplinks=uplinks, internal_cidrs=internal,
        datapath=DataPathOptions(mark_bit=mark_bit, ifbs=PerDirection(ifb, ingress_ifb), floors=floors, bpf_dir=bpf_dir),
        node_rate_bps=node_rates,
        controller=controller, controller_ca=controller_ca, controller_insecure_http=controller_insecure_http,
        token_path=token_path, report_period=report_period, resync_seconds=resync_period,
        default_floor_bps=floors.upload, from_file=tuple(from_file), kubeconfig=kubeconfig,
        listen=listen_at, state_listen=state_at, uplinks_learnt=not uplink, iptables_backend=iptables_backend,
        lean_metrics=lean_metrics, internal_counting=internal_counting, services_known=bool(service_cidr),
        services_from_cluster=not service_cidr and not from_file, metrics_auth=auth, state_dir=state_dir,
    )


METRICS_AUTH = ("auto", "true", "false")


def metrics_auth_wanted(mode: str, from_file: bool, listen_host: str) -> bool:
    """auto: on with Kubernetes on a non-loopback --listen (every pod of the node reaches it), off on
    loopback (only the node's own processes reach it) and in single-machine mode (no API server to
    review a token: /metrics is as open as --listen makes it)."""
    if mode not in METRICS_AUTH:
        raise ConfigError(f"--metrics-auth {mode!r}: choose {', '.join(METRICS_AUTH)}")
    if mode == "true" and from_file:
        raise ConfigError("--metrics-auth=true needs the API server (TokenReview, SubjectAccessReview): with "
                          "--from-file keep --listen on loopback instead")
    return mode == "true" or (mode == "auto" and not from_file and not is_loopback(listen_host))


def check_controller(url: str | None, ca: str | None, insecure_http: bool) -> None:
    """https:// needs a CA file that loads; http:// needs the explicit test-only flag."""
    if not url:
        if ca or insecure_http:
            raise ConfigError("--controller-ca and --controller-insecure-http need --controller")
        return
    try:
        endpoint, _ = parse_endpoint(url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if endpoint.scheme == "http":
        if not insecure_http:
            raise ConfigError(f"--controller {url} is plain http: the agent's token would travel in the clear. Use "
                              "https:// with --controller-ca (the controller Secret's ca.crt), or, in a test lab "
                              "only, add --controller-insecure-http (then no token is sent)")
        if ca:
            raise ConfigError("--controller-ca is for an https:// controller; this one is http://")
        return
    if not ca:
        raise ConfigError(f"--controller {url} needs --controller-ca FILE: the CA that signed the controller's "
                          "certificate (the Secret netagent-controller-tls, key ca.crt)")
    try:
        PinnedCA.load(ca)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--controller-ca {ca}: cannot load a CA certificate from it ({exc})") from None
    except Exception as exc:  # ssl.SSLError
        raise ConfigError(f"--controller-ca {ca}: not a PEM CA certificate ({exc})") from None
