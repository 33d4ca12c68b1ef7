"""The controller's configuration: typed and validated (the CLI defines the flags, `cli/main.py`)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from core.address import join_host_port, parse_host_port
from core.errors import ConfigError

DEFAULT_PORT = 9561
EXAMPLE = f"0.0.0.0:{DEFAULT_PORT}"


@dataclass(frozen=True)
class ControllerConfig:
    listen: tuple[str, int] = ("0.0.0.0", DEFAULT_PORT)
    metrics_listen: tuple[str, int] | None = None  # None: /metrics on the agent API's address
    advertise: str = ""  # host:port agents use to reach this replica when it leads
    from_file: tuple[str, ...] = ()  # policy from YAML files: no cluster, no election, no status writes
    kubeconfig: str | None = None
    period: float = 5.0
    answer_wait: float = 0.0
    lease_seconds: float = 30.0
    report_rate: float = 2.0
    report_ttl: float = 60.0
    status_interval: float = 30.0
    namespace: str = "netagent"
    lease_name: str = "netagent-controller"
    identity: str = ""
    election_lease_seconds: float = 15.0
    no_auth: bool = False
    agent_service_account: str | None = None  # NAMESPACE:NAME
    token_cache_seconds: float = 60.0


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
               report_rate: float, report_ttl: float, status_interval: float, namespace: str, lease_name: str,
               identity: str | None, election_lease_seconds: float, no_auth: bool,
               agent_service_account: str | None, token_cache_seconds: float) -> ControllerConfig:
    """The command line's values -> ControllerConfig, or ConfigError naming the flag."""
    if from_file and kubeconfig:
        raise ConfigError("give either --from-file (no cluster) or --kubeconfig, not both")
    if from_file and not no_auth:
        raise ConfigError("--from-file runs without a cluster, so agents cannot be authenticated: add --no-auth")
    if period <= 0 or lease_seconds <= period:
        raise ConfigError(f"--lease-seconds ({lease_seconds:g}) must be longer than --period "
                          f"({period:g}): agents would fall to the floor between rounds")
    if agent_service_account is not None:
        service_account_username(agent_service_account)
    host, port = parse_host_port(listen, "--listen", EXAMPLE)
    advertise = advertise or default_advertise(host, port)
    return ControllerConfig(
        listen=(host, port),
        metrics_listen=parse_host_port(metrics_listen, "--metrics-listen", EXAMPLE) if metrics_listen else None,
        advertise=advertise, from_file=tuple(from_file), kubeconfig=kubeconfig, period=period,
        answer_wait=answer_wait, lease_seconds=lease_seconds, report_rate=report_rate, report_ttl=report_ttl,
        status_interval=status_interval, namespace=namespace, lease_name=lease_name,
        identity=identity or f"{socket.gethostname()}@{advertise}", election_lease_seconds=election_lease_seconds,
        no_auth=no_auth, agent_service_account=agent_service_account, token_cache_seconds=token_cache_seconds,
    )
