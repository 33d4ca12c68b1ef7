"""The controller's configuration: typed and validated (the CLI defines the flags, `cli/main.py`)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from core.address import join_host_port, parse_host_port
from core.errors import ConfigError
from core.objects import DNS_NAME
from core.wire import AGENT_ANSWER_TIMEOUT

DEFAULT_PORT = 9561
EXAMPLE = f"0.0.0.0:{DEFAULT_PORT}"
# what one leader's event loop carries with CPU to spare for rounds and watches: 0.75 ms a report on a
# kept connection + a 0.73 s round at 10,000 x 30 pods = 8.3 s of a 10 s period (bench/report_cost.py)
DEFAULT_MAX_REPORTS_PER_SECOND = 1000.0
# agents' kept-alive connections (controller/connections.py)
DEFAULT_MAX_CONNECTIONS = 20_000  # 10,000 agents, each with a spare during a failover
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 8  # one agent (a node IP) needs 1, 2 during a failover
# TLS handshakes in progress at once (core/asynctls.HandshakeGate; docs/scale.md "Bad input at
# scale"): 64 made a 2,000-node storm slower (47 s until all answered: too few in flight to hide the
# clients' round trips), 512 did not (18.7 s, as without a bound)
DEFAULT_MAX_HANDSHAKES = 512
DEFAULT_TOKEN_CACHE_SECONDS = 60.0  # how long a TokenReview's verdict is reused at most
DEFAULT_KEEPALIVE_TIMEOUT = 75.0  # > the longest period the pacer advises by default (lease / 4 = 30 s)
DEFAULT_ELECTION_LEASE_SECONDS = 3.0  # docs/scale.md finding 13: failover in seconds
MIN_ELECTION_LEASE_SECONDS = 2.0  # the Lease stores whole seconds; shorter leaves calls no time to renew
DEFAULT_MAX_PENDING_REPORTS = 1000  # reports one replica holds at once; beyond: 503 Overloaded (controller/api.py)


@dataclass(frozen=True)
class ControllerConfig:
    listen: tuple[str, int] = ("0.0.0.0", DEFAULT_PORT)
    metrics_listen: tuple[str, int] | None = None  # None: /metrics on the agent API's address
    advertise: str = ""  # host:port agents use to reach this replica when it leads
    from_file: tuple[str, ...] = ()  # policy from YAML files: no cluster, no election, no status writes
    kubeconfig: str | None = None
    period: float = 5.0
    answer_wait: float = 0.0
    lease_seconds: float = 120.0  # answers in force add up to the budget: keeping them is safe
    report_rate: float = 2.0
    max_reports_per_second: float = DEFAULT_MAX_REPORTS_PER_SECOND  # all nodes together (controller/pacing.py)
    max_pending_reports: int = DEFAULT_MAX_PENDING_REPORTS
    # agents' kept-alive connections (controller/connections.py)
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_address: int = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    report_ttl: float = 150.0  # >= lease_seconds: a silent node's share is held while it may still use it
    status_interval: float = 30.0
    namespace: str = "netagent"
    lease_name: str = "netagent-controller"
    identity: str = ""
    # short: a killed leader is replaced within it (and a poll), and the new one answers from a round
    # at once (controller/state.py); never two leaders whatever its length (controller/leader.py)
    election_lease_seconds: float = DEFAULT_ELECTION_LEASE_SECONDS
    no_auth: bool = False
    agent_service_account: str | None = None  # NAMESPACE:NAME
    token_cache_seconds: float = DEFAULT_TOKEN_CACHE_SECONDS
    # TLS (docs/controller.md "TLS"): a Secret in `namespace` (cluster mode), files, or plain HTTP
    insecure_http: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_secret: str = "netagent-controller-tls"
    tls_manage: bool = True  # create the Secret when missing and renew its serving certificate
    tls_dns_names: tuple[str, ...] = ()
    tls_check_seconds: float = 60.0
    # /metrics only for a token allowed to get it (TokenReview + SubjectAccessReview: core/scrapeauth.py)
    metrics_auth: bool = False

    @property
    def tls_mode(self) -> str:
        """"insecure" (plain HTTP), "files" or "secret"."""
        if self.insecure_http:
            return "insecure"
        return "files" if self.tls_cert_file else "secret"


def service_dns_names(namespace: str, service: str = "netagent-controller") -> tuple[str, ...]:
    """The names agents use for the controller's Service: the serving certificate's default SANs."""
    return (service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local")


def service_account_username(spec: str) -> str:
    """`namespace:name` -> the username its tokens carry; ConfigError naming the flag otherwise."""
    namespace, sep, name = spec.partition(":")
    if not sep or not namespace or not name:
        raise ConfigError(f"--agent-service-account {spec!r} must be NAMESPACE:NAME, for example netagent:netagent-agent")
    return f"system:serviceaccount:{namespace}:{name}"


def default_advertise(listen_host: str, port: int) -> str:
    host = listen_host
    if host in ("0.0.0.0", "::", ""):
        host = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return join_host_port(host, port)


def from_flags(*, listen: str, metrics_listen: str | None, advertise: str | None, from_file: list[str],
               kubeconfig: str | None, period: float, answer_wait: float, lease_seconds: float,
               report_rate: float, report_ttl: float, status_interval: float,
               max_reports_per_second: float = DEFAULT_MAX_REPORTS_PER_SECOND,
               max_pending_reports: int = DEFAULT_MAX_PENDING_REPORTS,
               max_connections: int = DEFAULT_MAX_CONNECTIONS,
               max_connections_per_address: int = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
               max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
               keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT, namespace: str, lease_name: str,
               identity: str | None, election_lease_seconds: float, no_auth: bool,
               agent_service_account: str | None, token_cache_seconds: float, insecure_http: bool = False,
               tls_cert_file: str | None = None, tls_key_file: str | None = None,
               tls_secret: str = "netagent-controller-tls", tls_manage: bool = True,
               tls_dns_names: str | None = None, tls_check_seconds: float = 60.0,
               metrics_auth: str = "auto") -> ControllerConfig:
    """The command line's values -> ControllerConfig, or ConfigError naming the flag."""
    if from_file and kubeconfig:
        raise ConfigError("give either --from-file (no cluster) or --kubeconfig, not both")
    if from_file and not no_auth:
        raise ConfigError("--from-file runs without a cluster, so agents cannot be authenticated: add --no-auth")
    if period <= 0 or lease_seconds <= period:
        raise ConfigError(f"--lease-seconds ({lease_seconds:g}) must be longer than --period "
                          f"({period:g}): agents would fall to the floor between rounds")
    if not 0 <= max_reports_per_second < float("inf"):
        raise ConfigError(f"--max-reports-per-second ({max_reports_per_second:g}) must be 0 (no pacing) or a "
                          "positive number of reports per second")
    if not 1 <= max_pending_reports <= 100_000:
        raise ConfigError(f"--max-pending-reports ({max_pending_reports}) must be between 1 and 100000")
    if not 1 <= max_connections <= 1_000_000:
        raise ConfigError(f"--max-connections ({max_connections}) must be between 1 and 1000000")
    if not 1 <= max_connections_per_address <= max_connections:
        raise ConfigError(f"--max-connections-per-address ({max_connections_per_address}) must be between 1 and "
                          f"--max-connections ({max_connections})")
    if not 1 <= max_handshakes <= 1_000_000:
        raise ConfigError(f"--max-handshakes ({max_handshakes}) must be between 1 and 1000000")
    if not 0 < keepalive_timeout <= 3600:
        raise ConfigError(f"--keepalive-timeout ({keepalive_timeout:g}) must be between 0 and 3600 seconds")
    if not MIN_ELECTION_LEASE_SECONDS <= election_lease_seconds <= 3600:
        raise ConfigError(f"--election-lease-seconds ({election_lease_seconds:g}) must be between "
                          f"{MIN_ELECTION_LEASE_SECONDS:g} and 3600: the leader renews within 2/3 of it, each call "
                          "bounded by a quarter of that")
    if report_ttl < lease_seconds:
        raise ConfigError(f"--report-ttl ({report_ttl:g}) must be at least --lease-seconds ({lease_seconds:g}): a "
                          "node that cannot reach the controller keeps enforcing its last answer for the lease, so "
                          "its share must not be handed to others before then (the budget would be exceeded)")
    if agent_service_account is not None:
        service_account_username(agent_service_account)
    elif not from_file and not no_auth:
        raise ConfigError("--agent-service-account NAMESPACE:NAME is required in cluster mode: without it any "
                          "ServiceAccount's token could report for its node (the agent DaemonSet's, e.g. "
                          "netagent-system:netagent-agent; --no-auth only for tests)")
    if not 0 <= answer_wait <= AGENT_ANSWER_TIMEOUT - 1:
        raise ConfigError(f"--answer-wait ({answer_wait:g}) must be between 0 and {AGENT_ANSWER_TIMEOUT - 1:g} "
                          f"seconds: agents give up on an answer after {AGENT_ANSWER_TIMEOUT:g}s")
    if bool(tls_cert_file) != bool(tls_key_file):
        raise ConfigError("--tls-cert-file and --tls-key-file go together")
    if insecure_http and tls_cert_file:
        raise ConfigError("give either --insecure-http or --tls-cert-file/--tls-key-file, not both")
    if from_file and not insecure_http and not tls_cert_file:
        raise ConfigError("--from-file runs without a cluster, so there is no Secret for the serving certificate: "
                          "give --tls-cert-file/--tls-key-file (or --insecure-http for a single-machine demo)")
    names = tuple(n.strip() for n in (tls_dns_names or "").split(",") if n.strip()) or service_dns_names(namespace)
    for name in names:
        if not DNS_NAME.match(name):
            raise ConfigError(f"--tls-dns-names: {name!r} is not a DNS name")
    if tls_check_seconds <= 0:
        raise ConfigError("--tls-check-seconds must be positive")
    if metrics_auth not in METRICS_AUTH:
        raise ConfigError(f"--metrics-auth {metrics_auth!r}: choose {', '.join(METRICS_AUTH)}")
    if metrics_auth == "true" and (from_file or no_auth or insecure_http):
        raise ConfigError("--metrics-auth=true needs the API server and TLS (a bearer token never travels in the "
                          "clear): not with --from-file, --no-auth or --insecure-http")
    # auto: wherever agents are authenticated over TLS, scrapers are too
    guard_metrics = metrics_auth == "true" or (metrics_auth == "auto" and not (from_file or no_auth or insecure_http))
    host, port = parse_host_port(listen, "--listen", EXAMPLE)
    advertise = advertise or default_advertise(host, port)
    return ControllerConfig(
        listen=(host, port),
        metrics_listen=parse_host_port(metrics_listen, "--metrics-listen", EXAMPLE) if metrics_listen else None,
        advertise=advertise, from_file=tuple(from_file), kubeconfig=kubeconfig, period=period,
        answer_wait=answer_wait, lease_seconds=lease_seconds, report_rate=report_rate, report_ttl=report_ttl,
        max_reports_per_second=max_reports_per_second,
        max_pending_reports=max_pending_reports, max_connections=max_connections,
        max_connections_per_address=max_connections_per_address, max_handshakes=max_handshakes,
        keepalive_timeout=keepalive_timeout,
        status_interval=status_interval, namespace=namespace, lease_name=lease_name,
        identity=identity or f"{socket.gethostname()}@{advertise}", election_lease_seconds=election_lease_seconds,
        no_auth=no_auth, agent_service_account=agent_service_account, token_cache_seconds=token_cache_seconds,
        insecure_http=insecure_http, tls_cert_file=tls_cert_file, tls_key_file=tls_key_file, tls_secret=tls_secret,
        tls_manage=tls_manage, tls_dns_names=names, tls_check_seconds=tls_check_seconds, metrics_auth=guard_metrics,
    )


METRICS_AUTH = ("auto", "true", "false")
