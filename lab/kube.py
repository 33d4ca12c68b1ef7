"""A real Kubernetes control plane, in the manner of controller-runtime's envtest: etcd and
kube-apiserver on loopback (:class:`ControlPlane`: ephemeral ports, a temporary data directory,
``--authorization-mode=Node,RBAC``, service-account signing keys so TokenRequest and TokenReview
work, an admin client certificate and its kubeconfig), and on top of it kube-controller-manager,
kube-scheduler and kwok for a cluster of fake nodes (:class:`Cluster`: kwok turns Nodes annotated
``kwok.x-k8s.io/node=fake`` Ready and runs their pods).

Used by the tests (tests/kube.py wraps it in fixtures) and by the benchmarks that need a real API
server. The binaries come from ``make kube-assets`` (hack/kube-assets/build.sh) or
``NETAGENT_KUBE_ASSETS``.
"""
from __future__ import annotations

import base64
import ctypes
import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID
from kubernetes import client, config
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parent.parent
ASSETS_MODULE = REPO / "hack" / "kube-assets"
KWOK_STAGES = ASSETS_MODULE / "kwok" / "stages.yaml"
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kubectl")
CLUSTER_BINARIES = ("kube-controller-manager", "kube-scheduler", "kwok")
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
STOP_GRACE_SECONDS = 10


class KubeHarnessError(Exception):
    """The test control plane could not be built, started or used; the message says what and where."""


class KubeAssetsMissing(KubeHarnessError):
    pass


# ---------------------------------------------------------------------------------------------
# Assets


def kube_version() -> str:
    for line in (ASSETS_MODULE / "go.mod").read_text().splitlines():
        fields = line.split()
        if fields[:1] == ["require"]:
            fields = fields[1:]
        if len(fields) >= 2 and fields[0] == "k8s.io/kubernetes":
            return fields[1]
    raise KubeHarnessError(f"no k8s.io/kubernetes version in {ASSETS_MODULE / 'go.mod'}")


def cached_bin_dir(override_env: str, kind: str) -> Path:
    """$`override_env` if set, else ~/.cache/netagent/<kind>/<Kubernetes version>/bin (XDG_CACHE_HOME honoured)."""
    override = os.environ.get(override_env)
    if override:
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "netagent" / kind / kube_version() / "bin"


def assets_dir() -> Path:
    return cached_bin_dir("NETAGENT_KUBE_ASSETS", "kube-assets")


def find_assets(names: Iterable[str]) -> Path:
    directory = assets_dir()
    missing = [n for n in names if not os.access(directory / n, os.X_OK)]
    if missing:
        raise KubeAssetsMissing(
            f"Kubernetes test binaries missing from {directory}: {', '.join(missing)}; "
            "build them with `make kube-assets` (or set NETAGENT_KUBE_ASSETS to a directory holding them)"
        )
    return directory


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Keys, certificates, tokens


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _cert(subject_cn: str, key, issuer_cert, issuer_key, *, orgs=(), ca=False, server_names=(), server_ips=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        + [x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_cert.subject if issuer_cert else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usages = [x509.ExtendedKeyUsageOID.CLIENT_AUTH]
        if server_names or server_ips:
            usages.append(x509.ExtendedKeyUsageOID.SERVER_AUTH)
            sans = [x509.DNSName(n) for n in server_names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in server_ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


class Pki:
    """A throwaway CA, the apiserver's serving certificate, client certificates and the SA key."""

    def __init__(self, directory: Path):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert("netagent-test-ca", ca_key, None, None, ca=True)
        self.ca_file = self._store("ca", ca_cert, ca_key)
        self._ca = (ca_cert, ca_key)
        server_key = ec.generate_private_key(ec.SECP256R1())
        self.serving_cert, self.serving_key = self._store_pair(
            "apiserver",
            _cert(
                "kube-apiserver", server_key, ca_cert, ca_key,
                server_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                              "kubernetes.default.svc.cluster.local"),
                server_ips=("127.0.0.1", "10.96.0.1"),
            ),
            server_key,
        )
        # Service-account tokens are RS256 JWTs; the apiserver signs, TokenReview verifies.
        self.sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.sa_private_file = directory / "sa.key"
        _write_key(self.sa_private_file, self.sa_key)
        self.sa_public_file = directory / "sa.pub"
        self.sa_public_file.write_bytes(
            self.sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def client(self, name: str, user: str, groups: Iterable[str] = ()) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        return self._store_pair(name, _cert(user, key, *self._ca, orgs=tuple(groups)), key)

    def _store(self, name: str, cert, key) -> Path:
        return self._store_pair(name, cert, key)[0]

    def _store_pair(self, name: str, cert, key) -> tuple[Path, Path]:
        cert_file = self.dir / f"{name}.crt"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file = self.dir / f"{name}.key"
        _write_key(key_file, key)
        return cert_file, key_file


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode_rs256_jwt(claims: dict, private_key) -> str:
    """A JWT as the apiserver's service-account signer writes it (used to forge test tokens)."""
    header = {"alg": "RS256", "typ": "JWT"}
    signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
    signature = private_key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input}.{_b64url(signature)}"


def decode_jwt_claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def write_kubeconfig(path: Path, server: str, ca_file: Path, user: dict, name: str = "netagent-test") -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------------------------------------
# Processes


def _die_with_parent() -> None:
    """Runs in the child before exec: a pytest killed outright (SIGKILL, OOM) takes its control
    plane along instead of leaving it running."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Process:
    """One control-plane binary in its own process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], log_file: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_file = log_file
        self.env = dict(env or {})  # added to the inherited environment
        self.popen: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_file, "ab") as log:
            try:
                self.popen = subprocess.Popen(
                    self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**os.environ, **self.env} if self.env else None, start_new_session=True, preexec_fn=_die_with_parent,
                )
            except OSError as e:
                raise KubeHarnessError(f"cannot start {self.name} ({self.argv[0]}): {e}") from e

    def exit_code(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, graceful: bool = True) -> None:
        if self.popen is None:
            return
        signals = (signal.SIGTERM, signal.SIGKILL) if graceful else (signal.SIGKILL,)
        for sig in signals:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(STOP_GRACE_SECONDS)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may hold children that outlived the leader.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------------------------
# The control plane


class ControlPlane:
    """etcd + kube-apiserver on loopback. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        assets: Path,
        *,
        apiserver_port: int | None = None,
        etcd_servers: str | None = None,
        ready_timeout: float = 90.0,
        extra_apiserver_args: Iterable[str] = (),
        extra_etcd_args: Iterable[str] = (),
        apiserver_env: dict[str, str] | None = None,
    ):
        self.assets = assets
        self.ready_timeout = ready_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="netagent-kube-"))
        self.pki_dir = self.workdir / "pki"
        self._apiserver_port = apiserver_port
        self._external_etcd = etcd_servers
        self._extra_apiserver_args = list(extra_apiserver_args)
        self._extra_etcd_args = list(extra_etcd_args)
        self._apiserver_env = dict(apiserver_env or {})
        self.processes: list[Process] = []
        self.etcd_url = etcd_servers or ""
        self.url = ""
        self.pki: Pki | None = None
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self._admin_client = None

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self.pki = Pki(self.pki_dir)
            if not self._external_etcd:
                self._start_etcd()
            self._start_apiserver()
            admin_cert, admin_key = self.pki.client("admin", "netagent-test-admin", ["system:masters"])
            write_kubeconfig(
                self.kubeconfig, self.url, self.ca_file,
                {"client-certificate": str(admin_cert), "client-key": str(admin_key)},
            )
            self._wait_ready("kube-apiserver", self._apiserver_ready)
        except BaseException:
            self._preserve_logs()
            self.stop(graceful=False)  # a failed start has nothing worth a graceful shutdown
            raise

    def stop(self, graceful: bool = True) -> None:
        if self._admin_client is not None:
            self._admin_client.close()
            self._admin_client = None
        for process in reversed(self.processes):
            process.stop(graceful)
        self.processes.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again on the same port and etcd, as an upgrade or a
        crash does: clients must reconnect, and its watch cache starts afresh, so a watch resumed
        from a resourceVersion older than the restart gets 410 Gone."""
        old = self._process("kube-apiserver")
        old.stop()
        self.processes.remove(old)
        self.spawn("kube-apiserver", old.argv, old.env)
        try:
            self._wait_ready("kube-apiserver", self._apiserver_ready)
        except KubeHarnessError:
            self._preserve_logs()
            raise

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        """Start a binary whose lifetime this control plane owns (stopped by stop()); `env` is added to
        the inherited environment."""
        process = Process(name, argv, self.workdir / f"{name}.log", env)
        self.processes.append(process)
        process.start()
        return process

    def _start_etcd(self) -> None:
        client_port, peer_port = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        etcd = self.spawn("etcd", [
            str(self.assets / "etcd"),
            "--name=netagent-test",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=netagent-test={peer_url}",
            "--unsafe-no-fsync",  # throwaway data: no fsync keeps tests fast on shared disks
            "--log-level=warn",
            *self._extra_etcd_args,
        ])
        self._wait_ready("etcd", lambda: self._etcd_healthy(), process=etcd)

    def _etcd_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as r:
                return json.load(r).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _start_apiserver(self) -> None:
        port = self._apiserver_port or free_port()
        self.url = f"https://127.0.0.1:{port}"
        self.spawn("kube-apiserver", [
            str(self.assets / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",  # the loopback address may not back the kubernetes Service
            f"--secure-port={port}",
            f"--tls-cert-file={self.pki.serving_cert}",
            f"--tls-private-key-file={self.pki.serving_key}",
            f"--client-ca-file={self.ca_file}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={self.pki.sa_public_file}",
            f"--service-account-signing-key-file={self.pki.sa_private_file}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
            *self._extra_apiserver_args,
        ], env=self._apiserver_env)

    def _apiserver_ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=3, context=context) as r:
                return r.status == 200
        except (OSError, ssl.SSLError):
            return False

    def _wait_ready(self, name: str, ready, process: Process | None = None) -> None:
        process = process or self._process(name)
        deadline = time.monotonic() + self.ready_timeout
        while not ready():
            code = process.exit_code()
            if code is not None:
                raise KubeHarnessError(
                    f"{name} exited with code {code} before it became ready; log: {self._kept_log(process)}\n"
                    f"{process.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise KubeHarnessError(
                    f"{name} did not become ready within {self.ready_timeout:g} s; "
                    f"log: {self._kept_log(process)}\n{process.log_tail()}"
                )
            time.sleep(0.2)

    def _process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    @property
    def _failure_log_dir(self) -> Path:
        return Path(tempfile.gettempdir()) / "netagent-kube-logs" / self.workdir.name

    def _kept_log(self, process: Process) -> Path:
        """Where a failed start's log survives the teardown of the work directory."""
        return self._failure_log_dir / process.log_file.name

    def _preserve_logs(self) -> None:
        logs = [p.log_file for p in self.processes if p.log_file.exists()]
        if logs:
            self._failure_log_dir.mkdir(parents=True, exist_ok=True)
            for log in logs:
                shutil.copy2(log, self._failure_log_dir / log.name)

    # -- access -----------------------------------------------------------------------------

    @property
    def ca_file(self) -> Path:
        return self.pki.ca_file

    def client(self):
        """A kubernetes.client.ApiClient authenticated as the admin (system:masters)."""
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    @property
    def admin(self):
        """A shared admin ApiClient, closed at teardown (use client() for one of your own)."""
        if self._admin_client is None:
            self._admin_client = self.client()
        return self._admin_client

    def client_for_token(self, token: str):
        return config.new_client_from_config(config_file=str(self.kubeconfig_for_token(token)))

    def kubeconfig_for_token(self, token: str) -> Path:
        path = self.workdir / f"token-{uuid.uuid4().hex[:12]}.kubeconfig"
        return write_kubeconfig(path, self.url, self.ca_file, {"token": token})

    def kubeconfig_through(self, port: int, path: Path) -> Path:
        """The admin kubeconfig pointed at 127.0.0.1:`port` (a proxy in front of the apiserver)."""
        config = yaml.safe_load(self.kubeconfig.read_text())
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
        path.write_text(yaml.safe_dump(config))
        return path

    def kubectl(self, *args: str, check: bool = True, kubeconfig: Path | None = None,
                input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [str(self.assets / "kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        result = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout)
        if check and result.returncode:
            raise KubeHarnessError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def create_namespace(self, prefix: str = "t-") -> str:
        """A new namespace with its default ServiceAccount (which pods need, and which only
        kube-controller-manager would otherwise create); returns its name."""
        core = client.CoreV1Api(self.admin)
        name = core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(generate_name=prefix))).metadata.name
        try:
            core.create_namespaced_service_account(name, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="default")))
        except ApiException as e:
            if e.status != 409:  # kube-controller-manager was quicker
                raise
        return name

    def token_for_pod(self, namespace: str, service_account: str, pod_name: str,
                      audiences: Iterable[str] = (), seconds: int = 600) -> str:
        """A TokenRequest token for the ServiceAccount, bound to the pod (and so to its node)."""
        core = client.CoreV1Api(self.admin)
        pod = core.read_namespaced_pod(pod_name, namespace)
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=list(audiences) or [SERVICE_ACCOUNT_ISSUER],
                expiration_seconds=seconds,
                bound_object_ref=client.V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=pod_name, uid=pod.metadata.uid
                ),
            )
        )
        response = core.create_namespaced_service_account_token(service_account, namespace, request)
        return response.status.token

    def sign_service_account_token(self, claims: dict) -> str:
        """A JWT signed with the apiserver's own service-account key (for expired-token tests)."""
        return encode_rs256_jwt(claims, self.pki.sa_key)

    def compact_etcd(self) -> int:
        """Compact etcd at its current revision (physically); returns that revision."""
        if not self.etcd_url:
            raise KubeHarnessError("no etcd of this control plane to compact")
        header = self._etcd_call("/v3/kv/range", {"key": _b64("compact_rev_key")})["header"]
        revision = int(header["revision"])
        self._etcd_call("/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    def _etcd_call(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.etcd_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise KubeHarnessError(f"etcd {path} failed: {e.code} {e.read().decode(errors='replace')}") from e
        except OSError as e:
            raise KubeHarnessError(f"etcd {path} at {self.etcd_url} failed: {e}") from e


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# ---------------------------------------------------------------------------------------------
# Cluster: controllers, scheduler and kwok fake nodes


class Cluster:
    """kube-controller-manager, kube-scheduler and kwok on a ControlPlane's apiserver."""

    def __init__(self, control_plane: ControlPlane, ready_timeout: float = 90.0):
        self.api = control_plane
        self.ready_timeout = ready_timeout
        self.nodes: list[str] = []
        self.processes: list[Process] = []

    def start(self) -> None:
        api = self.api
        try:
            kcm_cert, kcm_key = api.pki.client("kube-controller-manager", "system:kube-controller-manager")
            kcm_config = write_kubeconfig(
                api.workdir / "kube-controller-manager.kubeconfig", api.url, api.ca_file,
                {"client-certificate": str(kcm_cert), "client-key": str(kcm_key)},
            )
            sched_cert, sched_key = api.pki.client("kube-scheduler", "system:kube-scheduler")
            sched_config = write_kubeconfig(
                api.workdir / "kube-scheduler.kubeconfig", api.url, api.ca_file,
                {"client-certificate": str(sched_cert), "client-key": str(sched_key)},
            )
            self.processes.append(api.spawn("kube-controller-manager", [
                str(api.assets / "kube-controller-manager"),
                f"--kubeconfig={kcm_config}",
                "--leader-elect=false",
                "--secure-port=0",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={api.pki.sa_private_file}",
                f"--root-ca-file={api.ca_file}",
                f"--cluster-signing-cert-file={api.ca_file}",
                f"--cluster-signing-key-file={api.ca_file.with_suffix('.key')}",
                "--controllers=*",
                "--v=1",
            ]))
            self.processes.append(api.spawn("kube-scheduler", [
                str(api.assets / "kube-scheduler"),
                f"--kubeconfig={sched_config}",
                f"--authentication-kubeconfig={sched_config}",
                f"--authorization-kubeconfig={sched_config}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--v=1",
            ]))
            self.processes.append(api.spawn("kwok", [
                str(api.assets / "kwok"),
                f"--kubeconfig={api.kubeconfig}",
                f"--config={KWOK_STAGES}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--server-address=127.0.0.1:{free_port()}",
                "--cidr=10.244.0.1/16",
                "--node-ip=10.0.0.1",
                "--node-lease-duration-seconds=40",
            ]))
            # kwok has no readiness endpoint we can rely on: a first fake node turning Ready proves
            # kwok runs, and the scheduler and controllers are checked by their own liveness here.
            time.sleep(1)
            self._check_alive()
        except BaseException:
            api._preserve_logs()
            self.stop()
            raise

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
            if process in self.api.processes:
                self.api.processes.remove(process)
        self.processes.clear()

    def _check_alive(self) -> None:
        for process in self.processes:
            code = process.exit_code()
            if code is not None:
                self.api._preserve_logs()
                raise KubeHarnessError(
                    f"{process.name} exited with code {code}; log: {self.api._kept_log(process)}\n{process.log_tail()}"
                )

    def add_nodes(self, count: int, prefix: str = "kwok-node", labels: dict | None = None) -> list[str]:
        """Create `count` fake Nodes managed by kwok; returns their names (wait with wait_ready)."""
        core = client.CoreV1Api(self.api.admin)
        names = []
        for _ in range(count):
            name = f"{prefix}-{len(self.nodes)}"
            core.create_node(client.V1Node(metadata=client.V1ObjectMeta(
                name=name,
                annotations={KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                labels={"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64", **(labels or {})},
            )))
            self.nodes.append(name)
            names.append(name)
        return names

    def wait_ready(self, nodes: Iterable[str] | None = None, timeout: float | None = None) -> None:
        """Wait until the nodes (default: all added) report Ready; a bounded, explained failure."""
        core = client.CoreV1Api(self.api.admin)
        wanted = set(self.nodes if nodes is None else nodes)
        timeout = self.ready_timeout if timeout is None else timeout

        def not_ready() -> set[str]:
            ready = {
                n.metadata.name
                for n in core.list_node(label_selector="type=kwok").items
                if any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
            }
            return wanted - ready

        pending = not_ready()
        deadline = time.monotonic() + timeout
        while pending:
            self._check_alive()
            if time.monotonic() > deadline:
                kwok = next(p for p in self.processes if p.name == "kwok")
                self.api._preserve_logs()
                raise KubeHarnessError(
                    f"{len(pending)} kwok nodes not Ready within {timeout:g} s (e.g. {sorted(pending)[:3]}); "
                    f"kwok log: {self.api._kept_log(kwok)}\n{kwok.log_tail()}"
                )
            time.sleep(0.5)
            pending = not_ready()
