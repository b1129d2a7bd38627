"""A scripted stand-in for a vLLM server, on a real local port: each POST gets the next of its answers, so
that the engine's HTTP client (aiohttp) is driven over a real socket, its failures included."""

from __future__ import annotations

import http.server
import json
import select
import threading
import time
from dataclasses import dataclass

CUT = "cut"  # 200, one streamed token, then the connection drops (the body is shorter than it said)
SILENT = "silent"  # 200, then nothing until the client goes away (`opened`, then `closed`, are set)
DROP = "drop"  # no answer: the connection is closed once the request is read (a keep-alive ending as it came)


@dataclass
class Answer:
    status: int
    body: bytes


class ScriptedVLLM:
    """Answers POSTs with `answers` in order (an Answer, CUT, SILENT or DROP; the last one is repeated); records
    each request's JSON body in `bodies` and its connection in `connections`. `down()` closes its port: a request then cannot connect."""

    def __init__(self, *answers: Answer | str, first_token: bytes = b"") -> None:
        self.answers, self.bodies = list(answers), []
        self.connections: list[int] = []  # each request's connection (its client port)
        self.first_token = first_token  # what CUT sends before dropping the connection
        self.opened, self.closed = threading.Event(), threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # (connections kept alive between requests)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fake.bodies.append(json.loads(raw))
                fake.connections.append(self.client_address[1])
                answer = fake.answers.pop(0) if len(fake.answers) > 1 else fake.answers[0]
                if answer == DROP:
                    self.close_connection = True
                    return
                if isinstance(answer, Answer):
                    self.send_response(answer.status)
                    self.send_header("Content-Length", str(len(answer.body)))
                    self.end_headers()
                    head, done, tail = answer.body.rpartition(b"data: [DONE]")
                    self.wfile.write(head)
                    self.wfile.flush()
                    if done:  # as vLLM: the end of a stream comes a moment after its last token
                        time.sleep(0.05)
                    self.wfile.write(done + tail)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", "100000")  # more than will come
                self.end_headers()
                if answer == CUT:
                    self.wfile.write(fake.first_token)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.flush()
                fake.opened.set()
                readable, _, _ = select.select([self.connection], [], [], 60)
                if readable and not self.connection.recv(1):  # the client closed its end
                    fake.closed.set()
                self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.http.server_port}"

    def down(self) -> ScriptedVLLM:
        """Stop listening: requests to it are refused (nothing answers on its port)."""
        self.stop()
        return self

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
