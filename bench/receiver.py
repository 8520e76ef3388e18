"""A minimal webhook endpoint for the HTTP benchmark, in its own process.

    python -m bench.receiver PORT [DELAY_MS]

Answers every POST with 204 after reading the body (HTTP/1.1 keep-alive), so the
benchmark measures the relay and its client, not a slow endpoint; or, with DELAY_MS,
after that long (an endpoint that takes its time, for the fairness figures).
"""

from __future__ import annotations

import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    delay = 0.0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.delay:
            time.sleep(self.delay)
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


def main() -> None:
    if len(sys.argv) > 2:
        Handler.delay = int(sys.argv[2]) / 1000
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
