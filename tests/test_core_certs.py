"""core/certs.py: the CA and serving certificate the controller serves with and agents pin."""

import datetime
import socket
import ssl
import threading

import pytest

from core import certs


def test_bundle_serves_tls_that_a_pinned_client_accepts(tmp_path):
    bundle = certs.new_bundle(["netagent-controller.netagent-system.svc"], ["127.0.0.1"])
    for name, data in bundle.as_dict().items():
        (tmp_path / name).write_bytes(data)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / certs.TLS_CERT, tmp_path / certs.TLS_KEY)
    client_ctx = ssl.create_default_context(cafile=str(tmp_path / certs.CA_CERT))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")

        t = threading.Thread(target=serve)
        t.start()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            # connect by IP, verify the Service name: how an agent reaches a leader behind a redirect
            with client_ctx.wrap_socket(raw, server_hostname="netagent-controller.netagent-system.svc") as tls:
                assert tls.recv(2) == b"ok"
        t.join(5)


def test_another_ca_is_refused(tmp_path):
    mine = certs.new_bundle(["a.example"])
    other_ca, _ = certs.new_ca("someone-else")
    ctx = ssl.create_default_context(cadata=other_ca.decode())
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    (tmp_path / "c").write_bytes(mine.tls_cert)
    (tmp_path / "k").write_bytes(mine.tls_key)
    server_ctx.load_cert_chain(tmp_path / "c", tmp_path / "k")
    a, b = socket.socketpair()
    with a, b:
        def serve():
            try:
                server_ctx.wrap_socket(b, server_side=True)
            except (ssl.SSLError, OSError):
                pass

        t = threading.Thread(target=serve)
        t.start()
        with pytest.raises(ssl.SSLCertVerificationError):
            ctx.wrap_socket(a, server_hostname="a.example")
        a.close()
        t.join(5)


def test_needs_renewal_reasons():
    b = certs.new_bundle(["x.svc"])
    assert certs.needs_renewal(b.tls_cert, b.ca_cert, ["x.svc"]) is None
    assert "names missing: y.svc" in certs.needs_renewal(b.tls_cert, b.ca_cert, ["x.svc", "y.svc"])
    late = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=certs.SERVING_DAYS - 10)
    assert certs.needs_renewal(b.tls_cert, b.ca_cert, ["x.svc"], now=late).startswith("expires")
    other_ca, _ = certs.new_ca("other")
    assert certs.needs_renewal(b.tls_cert, other_ca, ["x.svc"]) is not None
    assert certs.needs_renewal(b"junk", b.ca_cert, ["x.svc"]).startswith("unparsable")
    with pytest.raises(ValueError):
        certs.issue_serving(b.ca_cert, b.ca_key, [])
