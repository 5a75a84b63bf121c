"""A Jupyter server's API as the activity collector asks it: one HTTP (or HTTPS, self-signed, as a SageMaker
notebook instance serves it) server on 127.0.0.1 hosting several Jupyter servers, one per base URL, each with
its token ("" for a server without one, as on a notebook instance: no Authorization header expected)."""

from __future__ import annotations

import ssl
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeJupyter:
    def __init__(self, tls_dir: Path | None = None) -> None:
        """`tls_dir`: serve HTTPS with a self-signed certificate written there."""
        self.routes: dict[str, tuple[str, int, bytes, dict[str, str]]] = {}
        self.requests: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests.append(self.path)
                route = fake.routes.get(self.path.partition("?")[0])
                if route is None:
                    self.send_error(404)
                    return
                token, status, body, headers = route
                if self.headers.get("Authorization") != (f"token {token}" if token else None):
                    self.send_error(403)
                    return
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls_dir is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*self_signed(tls_dir))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def serve(
        self, base: str, token: str, kernels: bytes, sessions: bytes = b"[]", kernelspecs: bytes | None = None
    ) -> None:
        """One server's answers; without `kernelspecs`, a server that does not say which kernels it runs (404)."""
        self.routes[base + "api/kernels"] = (token, 200, kernels, {})
        self.routes[base + "api/sessions"] = (token, 200, sessions, {})
        if kernelspecs is not None:
            self.routes[base + "api/kernelspecs"] = (token, 200, kernelspecs, {})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate and its key for a machine's own name, as a notebook instance's Jupyter has."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ip-172-16-0-1")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file
