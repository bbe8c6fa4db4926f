"""A stand-in launcher for the launcher's tests: it answers /health on ``--port``, unless
that port is taken, where it logs the bind error and stays up without an HTTP server, as
SGLang's launcher does when uvicorn cannot bind."""

from __future__ import annotations

import argparse
import http.server
import time


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the handler's API
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    port = p.parse_known_args()[0].port
    try:
        server = http.server.HTTPServer(("127.0.0.1", port), Health)
    except OSError as e:
        print(
            f"ERROR:    [Errno {e.errno}] error while attempting to bind on address "
            f"('127.0.0.1', {port}): address already in use",
            flush=True,
        )
        while True:
            time.sleep(1)
    server.serve_forever()


if __name__ == "__main__":
    main()
