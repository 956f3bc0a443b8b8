"""A real HTTP webhook receiver on 127.0.0.1 (loopback only), in a thread: it records
each request's path, headers and raw body, and answers with the statuses it is told
(e.g. 500 then 200), the last one from then on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    url: str
    answers: list[int] = field(default_factory=lambda: [200])
    requests: list[Received] = field(default_factory=list)


@contextmanager
def webhook_receiver(answers: list[int] | None = None) -> Iterator[Receiver]:
    state: Receiver = Receiver(url="")
    if answers:
        state.answers = list(answers)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock:
                state.requests.append(Received(self.path, dict(self.headers.items()), body))
                code = state.answers.pop(0) if len(state.answers) > 1 else state.answers[0]
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
