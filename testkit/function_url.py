"""The real Slack handler behind a local HTTP server, as its Lambda Function URL serves it: each request becomes
a Function URL event (payload version 2.0) and the handler's answer the HTTP response."""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from idle_reaper_tools.fake_slack import LambdaContextStub


def _handler() -> type[BaseHTTPRequestHandler]:
    from idle_reaper.handlers.slack import handler

    class FunctionUrl(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            url = urllib.parse.urlsplit(self.path)
            event: dict[str, Any] = {
                "version": "2.0",
                "routeKey": "$default",
                "rawPath": url.path,
                "rawQueryString": url.query,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "requestContext": {
                    "http": {"method": "POST", "path": url.path, "sourceIp": self.client_address[0]},
                    "stage": "$default",
                },
                "body": body,
                "isBase64Encoded": False,
            }
            answer = handler(event, LambdaContextStub(function_name="idle-reaper-slack"))  # type: ignore[arg-type]
            text = str(answer.get("body") or "").encode()
            self.send_response(int(answer["statusCode"]))
            for key, value in (answer.get("headers") or {}).items():
                self.send_header(key, str(value))
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return FunctionUrl


@contextmanager
def slack_function_url() -> Iterator[str]:
    """The handler served on 127.0.0.1; yields its base URL (what the SlackFunctionUrl output holds)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
