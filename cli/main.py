"""The `netagent` command: every subcommand and every flag, defined once.

Flags become a typed, validated config here (`netagent.config`, `controller.config`); no
argparse Namespace travels below this module. This is the top of the house: it may
import both processes and the lab; nothing imports it but `python -m netagent`.
"""
from __future__ import annotations

import argparse
import ctypes
import faulthandler
import inspect
import json
import logging
import os
import signal
import sys
import threading
import traceback

from controller import config as controller_config
from core.errors import NetagentError
from core.logsetup import setup as setup_logging
from netagent import config as agent_config
from netagent import version_line
from netagent.options import COUNTING_MODES, DEFAULT_MARK_BIT, DataPathOptions

# Each subcommand imports the code it runs inside its handler, so a process loads only its own
# part: the agent never loads the controller's web server, the engine's numpy, or the demo's
# terminal UI (tests/test_layers.py holds this). import-linter still sees every one of these arrows.

log = logging.getLogger("netagent")
SHUTDOWN_GRACE_S = 10.0
STOP_POLL_S = 0.25
IPTABLES_BACKENDS = ("auto", "nft", "legacy")


def _int(text: str) -> int:
    return int(text, 0)


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return value in ("true", "1", "yes")


def _flags_for(build, a: argparse.Namespace) -> dict:
    """The parsed flags that a config builder takes, by name (--report-period is report_period):
    a flag is defined once, here, and never listed again."""
    return {name: getattr(a, name) for name in inspect.signature(build).parameters}


# -- flags shared by several subcommands: each defined once, here ------------------------------

def _policy_sources(p: argparse.ArgumentParser, what: str) -> None:
    src = p.add_argument_group(f"where {what} come from (one of)")
    src.add_argument("--from-file", action="append", default=[], metavar="PATH",
                     help="YAML file or directory of Pod/EgressClass/EgressBudget objects; no cluster "
                          "(repeatable; reloaded on change)")
    src.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")


def _listen(p: argparse.ArgumentParser, default: str, what: str) -> None:
    p.add_argument("--listen", default=default, help=f"HOST:PORT for {what} (default {default})")


def _logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--log-level", default="info")


def _iptables_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iptables-backend", choices=IPTABLES_BACKENDS, default="auto",
                   help="iptables backend (default: detected as kubelet and kube-proxy use it)")


# -- subcommands ---------------------------------------------------------------------------

def _run_flags(p: argparse.ArgumentParser) -> None:
    _policy_sources(p, "pods and policy")
    p.add_argument("--node", help="this node's name (required with Kubernetes; in file mode, pods of other nodes are ignored)")
    p.add_argument("--controller", metavar="URL",
                   help="controller base URL, https://HOST:PORT; without it the agent allocates locally")
    p.add_argument("--controller-ca", metavar="FILE",
                   help="the CA that signed the controller's certificate (the Secret's ca.crt; re-read when it "
                        "changes); only this CA is trusted for the controller")
    p.add_argument("--controller-insecure-http", action="store_true",
                   help="allow an http:// --controller (test labs only; no token is sent then)")
    p.add_argument("--token-path", default=agent_config.DEFAULT_TOKEN_PATH,
                   help="projected ServiceAccount token presented to the controller")
    p.add_argument("--uplink", action="append", default=[], metavar="DEV",
                   help="internet-facing device (repeatable; default: the devices of the default routes)")
    p.add_argument("--internal-cidr", action="append", default=[], metavar="CIDR",
                   help="destination that is never shaped (repeatable); the uplinks' subnets are added automatically")
    p.add_argument("--pod-cidr", action="append", default=[], metavar="CIDR", help="this node's pod CIDR(s) (internal)")
    p.add_argument("--service-cidr", action="append", default=[], metavar="CIDR", help="the cluster's service CIDR(s)")
    _listen(p, agent_config.DEFAULT_LISTEN, "/metrics /healthz /readyz (and /state when it is a loopback address)")
    p.add_argument("--state-listen", default=agent_config.DEFAULT_STATE_LISTEN,
                   help="loopback HOST:PORT for /state (the pod inventory) when --listen is not loopback "
                        f"(default {agent_config.DEFAULT_STATE_LISTEN})")
    p.add_argument("--state-dir", default="/var/lib/netagent",
                   help="single-machine mode (no --controller) keeps its teams' quota use here, in quota.json "
                        "(default /var/lib/netagent; docs/quotas.md)")
    p.add_argument("--metrics-auth", choices=agent_config.METRICS_AUTH, default="auto",
                   help="/metrics only for a bearer token allowed to get the nonResourceURL /metrics (TokenReview + "
                        "SubjectAccessReview), and --listen serves HTTPS with a self-signed certificate; auto: with "
                        "Kubernetes on a non-loopback --listen (default auto; docs/agent.md)")
    _logging(p)
    p.add_argument("--mark-bit", type=_int, default=DEFAULT_MARK_BIT, help=f"firewall-mark bit (default {DEFAULT_MARK_BIT:#x})")
    p.add_argument("--ifb", default=DataPathOptions.ifbs.upload, help="name of the IFB device netagent owns")
    p.add_argument("--default-rate", default="1M", help="floor for internet traffic from unknown sources (bit/s quantity)")
    p.add_argument("--ingress-rate", metavar="Q",
                   help="downloads (internet -> pod): the node's download rate when no controller gives one "
                        "(single-node mode: default the EgressBudget's ingressTotal, else no node limit)")
    p.add_argument("--ingress-default-rate", default="1M",
                   help="downloads: the floor for pods the agent does not know yet, and each pod's download "
                        "rate while nothing better is known (bit/s quantity)")
    p.add_argument("--ingress-ifb", default=DataPathOptions.ifbs.download,
                   help="name of the IFB device netagent owns for downloads")
    p.add_argument("--internal-counting", choices=COUNTING_MODES, default="auto",
                   help="where each pod's internal bytes are counted: on its own device by an eBPF program "
                        "(internal packets then cost no set lookup: docs/datapath.md) or by the rules in ipsets; "
                        "auto: the device when the kernel allows it, --bpf-dir's parent is a bpf filesystem and "
                        "--service-cidr is given (default auto)")
    p.add_argument("--bpf-dir", default=DataPathOptions.bpf_dir,
                   help="where the device counter pins its map, on a bpf filesystem: a restarted agent adopts it "
                        f"(default {DataPathOptions.bpf_dir})")
    p.add_argument("--report-period", type=float, default=5.0, help="seconds between controller reports")
    p.add_argument("--lean-metrics", action="store_true",
                   help="export 4 series a pod instead of 10 (internet bytes both ways, throttled seconds, info; "
                        "no per-pod limit/allocation/demand/drops, no in-cluster scope): for very large clusters, "
                        "docs/scale.md")
    p.add_argument("--resync-period", type=float, default=30.0,
                   help="seconds between resyncs that re-read the whole kernel state and repair drift")
    _iptables_backend(p)


M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """At most `arenas` glibc malloc arenas for the whole process. glibc gives each thread that
    allocates its own (up to 8 per core), and each keeps what it once held; the agent's ten threads
    allocate mostly under the GIL, one at a time, so two arenas cost no waiting and hold ~1 MiB
    less RSS (110 pods, local mode). Call it before starting threads. False where there is no
    glibc mallopt (musl): nothing to tune there."""
    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def _run(a: argparse.Namespace) -> int:
    limit_malloc_arenas()
    setup_logging(a.log_format, a.log_level)
    try:
        from netagent.daemon import Daemon

        cfg = agent_config.from_flags(**_flags_for(agent_config.from_flags, a))
        daemon = Daemon.build(cfg)
    except (NetagentError, OSError) as exc:  # configuration and environment errors: say what and stop
        log.error("cannot start: %s", exc)
        return 2
    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("signal %d: stopping; the data path stays in force (fail-static)", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # `kill -USR1` writes every thread's stack to the log (a stuck agent, diagnosed in place)
    signal.signal(signal.SIGUSR1, dump_threads)
    daemon.start()
    log.info("netagent running on node %r; /metrics /healthz /readyz at %s://%s; /state at http://%s", cfg.node,
             "https" if cfg.metrics_auth else "http", daemon.http.address, daemon.http.state_address or "(not served)")
    wait_until_set(stop)
    # Stopping changes nothing in the kernel, so a stop that hangs (a tool blocked on the
    # xtables lock, a netlink socket) must not keep the pod past its grace period: after
    # SHUTDOWN_GRACE_S say where every thread stands and exit; the data path stays in force.
    watchdog = threading.Timer(SHUTDOWN_GRACE_S, _exit_stuck)
    watchdog.daemon = True
    watchdog.start()
    daemon.stop()
    watchdog.cancel()
    return 0


def wait_until_set(stop: threading.Event) -> None:
    """Wait, in slices, for a signal handler to set `stop`. The kernel may hand SIGTERM to a
    thread other than the main one (one spawning ipset, say: in a tests/test_agent_shutdown.py loop
    about one signal in four); that thread's C handler only flags it, Python runs the handler
    in the main thread at its next bytecode, and an untimed wait never gets there. CI saw an
    agent ignore SIGTERM for 20 s that way."""
    while not stop.wait(STOP_POLL_S):
        pass


def dump_threads(signum=None, frame=None) -> None:
    """Every thread's stack to stderr, from a Python signal handler: it runs in the main thread
    with the GIL held, so no other thread changes its frames while they are read. faulthandler's
    C handler (used before) walks them while they run, and CI saw it crash the agent in the
    middle of a dump (a frame read mid-change). The main thread waits in slices
    (wait_until_set), so the handler runs within STOP_POLL_S."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, top in sys._current_frames().items():
        lines.append(f"Thread {ident:#x} {names.get(ident, '?')!r} (most recent call first):")
        lines.extend(entry.rstrip("\n") for entry in reversed(traceback.format_stack(top)))
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()


def _exit_stuck() -> None:
    log.error("stopping took over %.0f s; exiting now (the data path stays in force). Threads:", SHUTDOWN_GRACE_S)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    logging.shutdown()
    os._exit(0)


def _status_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", help="where the agent serves /state: its --listen when that is loopback, else its "
                                   f"--state-listen (default: {agent_config.DEFAULT_STATE_LISTEN}, then "
                                   f"{agent_config.DEFAULT_LISTEN})")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    cluster = p.add_argument_group("the cluster view, from a laptop (any of these selects it; docs/operations.md)")
    cluster.add_argument("--kubeconfig", metavar="PATH", help="kubeconfig to read the cluster with "
                         "(default with --context/-n: $KUBECONFIG or ~/.kube/config)")
    cluster.add_argument("--context", help="the kubeconfig context to use")
    cluster.add_argument("-n", "--namespace", help="where netagent runs (default: netagent-system)")
    cluster.add_argument("--controller", metavar="URL", help="reach the controller here (e.g. https://127.0.0.1:8443 "
                         "through `kubectl port-forward`) instead of at the address its Lease names")
    cluster.add_argument("--controller-ca", metavar="FILE", help="the CA of the controller's certificate (default: "
                         "ca.crt of the Secret --tls-secret, when you may read it)")
    cluster.add_argument("--tls-secret", default="netagent-controller-tls", help=argparse.SUPPRESS)
    cluster.add_argument("--lease-name", default="netagent-controller", help="the controller's Lease")
    cluster.add_argument("--top", type=int, default=10, help="how many of the busiest pods to list (at most 100)")


def _cluster_status(a: argparse.Namespace) -> int:
    from cli import cluster, clusterview

    try:
        api, context = cluster.load(a.kubeconfig, a.context)
    except cluster.KubeconfigError as exc:
        print(exc, file=sys.stderr)
        return clusterview.EXIT_DEGRADED
    with api:
        snapshot = cluster.gather(api, context, a.namespace or cluster.DEFAULT_NAMESPACE, lease_name=a.lease_name,
                                  controller_url=a.controller, controller_ca=a.controller_ca,
                                  tls_secret=a.tls_secret, top=a.top)
    v = clusterview.view(snapshot)
    print(json.dumps(v, indent=2) if a.output == "json" else clusterview.render(v))
    return v["exit_code"]


def _status(a: argparse.Namespace) -> int:
    from netagent import status

    if getattr(a, "cluster", False) or a.kubeconfig or a.context or a.namespace or a.controller:
        return _cluster_status(a)
    where = [a.agent] if a.agent else [agent_config.DEFAULT_STATE_LISTEN, agent_config.DEFAULT_LISTEN]
    for i, agent in enumerate(where):
        try:
            state = status.fetch_state(agent)
            break
        except OSError as exc:
            if i == len(where) - 1:
                print(f"cannot reach the agent at {' or '.join(where)}: {exc} (is `netagent run` running? see --agent)")
                return 1
    if a.output == "json":
        print(json.dumps(state, indent=2))
    else:
        print(status.render(state))
    return 0


def _cleanup_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ifb", default=DataPathOptions.ifbs.upload, help="the IFB device netagent used (its --ifb)")
    p.add_argument("--ingress-ifb", default=DataPathOptions.ifbs.download,
                   help="the download IFB device netagent used (its --ingress-ifb)")
    p.add_argument("--bpf-dir", default=DataPathOptions.bpf_dir,
                   help="where the device counter pinned its map (its --bpf-dir)")
    _iptables_backend(p)


def _cleanup(a: argparse.Namespace) -> int:
    from netagent import cleanup

    done, failed = cleanup.cleanup((a.ifb, a.ingress_ifb), a.iptables_backend, a.bpf_dir)
    for line in failed:
        print(line)
    for item in done:
        print(f"removed {item}")
    if not done and not failed:
        print("nothing of netagent's found: already clean")
    return 1 if failed else 0


def _plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-file", "-f", dest="from_file", metavar="POLICY.yaml", action="append", required=True,
                   help="YAML file (or directory of them) with EgressClass and EgressBudget objects; repeatable")
    p.add_argument("--demand", "-d", metavar="DEMAND.csv", required=True,
                   help="CSV with columns namespace,pod,class,demand[,bandwidth][,ingress_demand][,ingress_bandwidth] "
                        "(ingress = downloads, planned when ingress_demand is given); '-' reads standard input")
    p.add_argument("--output", "-o", choices=("table", "wide", "json"), default="table",
                   help="output format (default: table; wide adds each pod's weight, guarantee and cap)")
    p.add_argument("--used", action="append", default=[], metavar="TEAM=BYTES[,uploads|downloads]",
                   help="a team's volume quota use this period (uploads unless named; repeatable): a spent quota is "
                        "planned at its exhaustedRate and a QUOTAS table says which teams exhaust first at this "
                        "demand (docs/quotas.md)")


def _plan(a: argparse.Namespace) -> int:
    from controller import whatif

    return whatif.run(a.from_file, a.demand, a.output, a.used)


def _controller_flags(p: argparse.ArgumentParser) -> None:
    _policy_sources(p, "the policy (and, in file mode, pod placement)")
    _listen(p, controller_config.EXAMPLE, "the agent API (also /metrics unless --metrics-listen)")
    p.add_argument("--metrics-listen", help="serve /metrics on this address instead of the agent API's")
    p.add_argument("--advertise", help="host:port agents use to reach this replica when it leads "
                                       "(default: $POD_IP, else this host's address, with the --listen port)")
    p.add_argument("--period", type=float, default=5.0, help="seconds between allocation rounds")
    p.add_argument("--answer-wait", type=float, default=0.0, metavar="SECONDS",
                   help="hold each report's answer until the next round, at most this long, so it reflects that "
                        "report (one report period less of reaction time; use with a short --period, e.g. "
                        "--period 0.5 --answer-wait 0.7); 0 answers at once from the latest round")
    p.add_argument("--lease-seconds", type=float, default=120.0,
                   help="how long agents keep an answer's allocations without a fresh one (then the safe floor); "
                        "the answers in force always add up to the budget, so a long lease is safe and rides out "
                        "an API server outage or a failover")
    p.add_argument("--report-rate", type=float, default=2.0, help="reports per second allowed per node (burst 3x)")
    p.add_argument("--max-reports-per-second", type=float, default=controller_config.DEFAULT_MAX_REPORTS_PER_SECOND,
                   metavar="RATE",
                   help="reports per second the leader takes from all agents together: above RATE x --period nodes it "
                        "asks agents to report less often (nodes / RATE seconds, at most a quarter of --lease-seconds), "
                        "so one leader carries any cluster; reaction time grows with the period (docs/scale.md); "
                        "0 turns pacing off")
    p.add_argument("--max-pending-reports", type=int, default=controller_config.DEFAULT_MAX_PENDING_REPORTS,
                   metavar="N",
                   help="reports one replica holds at once (authenticating, reading, waiting for a round); more are "
                        "shed at once with 503 Overloaded and a Retry-After of the paced period, which agents honour: "
                        "a leader offered more than it answers keeps its memory flat")
    p.add_argument("--max-connections", type=int, default=controller_config.DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="agent connections one replica keeps open at once (agents keep one alive between reports, so "
                        "a report costs no TLS handshake); more are closed on accept and counted "
                        "(netagent_controller_connections_refused_total)")
    p.add_argument("--max-connections-per-address", type=int,
                   default=controller_config.DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, metavar="N",
                   help="connections one client address may keep open (an agent needs 1, 2 during a failover)")
    p.add_argument("--max-handshakes", type=int, default=controller_config.DEFAULT_MAX_HANDSHAKES, metavar="N",
                   help="TLS handshakes one replica works on at once (a reconnect storm after a restart); more "
                        "connections are closed on accept, before their handshake, and counted "
                        "(netagent_controller_connections_refused_total{reason=\"TooManyHandshakes\"}); "
                        "their agents keep their limits and come back after their jittered period")
    p.add_argument("--keepalive-timeout", type=float, default=controller_config.DEFAULT_KEEPALIVE_TIMEOUT,
                   metavar="SECONDS",
                   help="an agent connection idle this long is closed (longer than the report period, so "
                        "connections are kept between reports)")
    p.add_argument("--report-ttl", type=float, default=150.0,
                   help="a node silent this long leaves the allocation (at least --lease-seconds: until then it may "
                        "still enforce its last answer)")
    p.add_argument("--status-interval", type=float, default=30.0,
                   help="at most one EgressBudget status write per this many seconds (only on change)")
    le = p.add_argument_group("leader election (cluster mode)")
    le.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "netagent"), help="namespace of the Lease")
    le.add_argument("--lease-name", default="netagent-controller", help="name of the Lease")
    le.add_argument("--identity", help="holder identity (default: <hostname>@<advertise>; the part after @ is "
                                       "where followers send agents)")
    le.add_argument("--election-lease-seconds", type=float, default=controller_config.DEFAULT_ELECTION_LEASE_SECONDS,
                    help="Lease duration: a dead leader is replaced after this long (renewed every 2/15 of it; "
                         "default %(default)g)")
    auth = p.add_argument_group("agent authentication (cluster mode)")
    auth.add_argument("--no-auth", action="store_true", help="accept reports without a token (demo/tests only)")
    auth.add_argument("--agent-service-account", metavar="NAMESPACE:NAME",
                      help="accept only tokens of this ServiceAccount, the agent DaemonSet's (required in cluster "
                           "mode unless --no-auth)")
    auth.add_argument("--metrics-auth", choices=controller_config.METRICS_AUTH, default="auto",
                      help="/metrics only for a bearer token allowed to get the nonResourceURL /metrics (TokenReview + "
                           "SubjectAccessReview); auto: in cluster mode with agent authentication and TLS (default auto)")
    auth.add_argument("--token-cache-seconds", type=float, default=controller_config.DEFAULT_TOKEN_CACHE_SECONDS, help="how long a TokenReview verdict is reused at most (each for a random 75-100%% of it)")
    tls = p.add_argument_group("TLS (HTTPS by default; docs/controller.md)")
    tls.add_argument("--tls-secret", default="netagent-controller-tls",
                     help="Secret (in --namespace) with ca.crt, ca.key, tls.crt, tls.key (cluster mode)")
    tls.add_argument("--tls-manage", type=_bool, default=True, metavar="true|false",
                     help="create the Secret when missing and renew its serving certificate (default true; "
                          "false when cert-manager owns the Secret)")
    tls.add_argument("--tls-dns-names", metavar="NAME,...",
                     help="names of the serving certificate (default: the Service netagent-controller's names "
                          "in --namespace)")
    tls.add_argument("--tls-cert-file", metavar="PATH", help="serving certificate chain (PEM) instead of the Secret; "
                                                              "re-read on change")
    tls.add_argument("--tls-key-file", metavar="PATH", help="its private key (PEM)")
    tls.add_argument("--tls-check-seconds", type=float, default=60.0,
                     help="how often the Secret or files are checked for a new or expiring certificate")
    tls.add_argument("--insecure-http", action="store_true",
                     help="serve plain HTTP (agents' tokens in the clear): single-machine demos and tests only")
    _logging(p)


def _controller(a: argparse.Namespace) -> int:
    setup_logging(a.log_format, a.log_level)
    try:
        cfg = controller_config.from_flags(**_flags_for(controller_config.from_flags, a))
    except NetagentError as exc:
        logging.getLogger("netagent.controller").error("cannot start: %s", exc)
        return 2
    from controller import app

    return app.run(cfg)


def _demo_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic (default 60)")
    p.add_argument("--png", default="netagent-demo.png", help="where to write the chart of rates over time")
    p.add_argument("--plain", action="store_true", help="print lines instead of a live table (default when not a TTY)")
    p.add_argument("--summary-json", metavar="PATH", help="also write the measured series and fair shares as JSON")
    p.add_argument("--stagger", type=float, default=0.0, metavar="SECONDS",
                   help="start the second node's pods this long after the first node's (a cold start where one "
                        "node's first report comes before its flows; default 0)")
    p.add_argument("--keep-logs", metavar="DIR", help="copy the agents', controller's and iperf3's logs here at the end")


def _demo(a: argparse.Namespace) -> int:
    try:  # the lab is tooling beside the product: in a source checkout, not in the wheel or the image
        from lab import demo
    except ModuleNotFoundError as exc:
        if exc.name == "lab":
            print("netagent demo runs from a source checkout (the lab is not part of the installed product): "
                  "git clone the project, then `sudo bash scripts/bootstrap.sh --demo && sudo .venv/bin/python -m netagent demo`",
                  file=sys.stderr)
        else:
            print(f"netagent demo needs {exc.name}: pip install -e '.[demo]' (or `sudo bash scripts/bootstrap.sh --demo`)",
                  file=sys.stderr)
        return 2
    return demo.run(demo.DemoOptions(duration=a.duration, png=a.png, plain=a.plain, summary_json=a.summary_json,
                                     stagger=a.stagger, keep_logs=a.keep_logs))


# name -> (help, flags, run)
SUBCOMMANDS = {
    "run": ("run the per-node agent", _run_flags, _run),
    "status": ("print this node's pods: class, allocation, rate, bytes, drops", _status_flags, _status),
    "cleanup": ("remove everything netagent created on this node (idempotent)", _cleanup_flags, _cleanup),
    "plan": ("print the allocation a policy gives for given demands", _plan_flags, _plan),
    "controller": ("run the central controller", _controller_flags, _controller),
    "demo": ("run the single-machine demo (root; needs no cluster)", _demo_flags, _demo),
}


class _Version(argparse.Action):
    """--version printed as one line (argparse's own action wraps it at the terminal's width)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netagent", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, flags, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # `netagent controller --version` as well: the Deployment's command line plus one flag
        p.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
        flags(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


def kubectl_plugin(argv: list[str] | None = None) -> int:
    """`kubectl netagent status ...` (the executable kubectl-netagent on PATH): `netagent status`'s
    cluster view, with kubectl's default kubeconfig when no --kubeconfig is given."""
    parser = argparse.ArgumentParser(prog="kubectl netagent", description="netagent's cluster view, as a kubectl plugin")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("status", help="the cluster view: budget, teams, top pods, agents, controller",
                       description="the cluster view: budget, teams, top pods, agents, controller")
    _status_flags(p)
    p.set_defaults(_run=_status, cluster=True)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
