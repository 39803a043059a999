"""A minimal HTTP/2 client (cleartext, prior knowledge) on the `h2` package, for requests that end
with trailers, which Python's standard library cannot send. One request per connection."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events

from client import REPLICA_HEADER


@dataclass
class H2Result:
    status: int = 0
    headers: dict = field(default_factory=dict)
    body: bytes = b""

    @property
    def replica(self) -> str:
        return self.headers.get(REPLICA_HEADER, "")

    def json(self) -> dict:
        return json.loads(self.body)


def post(host: str, port: int, path: str, body: bytes, headers: dict | None = None,
         trailers: dict | None = None, timeout_s: float = 30.0) -> H2Result:
    """POST `body` over HTTP/2 to `host:port`; with `trailers`, the body's last DATA frame does not
    end the stream: a HEADERS frame with the trailers does."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        req = [(":method", "POST"), (":path", path), (":scheme", "http"),
               (":authority", f"{host}:{port}"), ("content-type", "application/json"),
               ("content-length", str(len(body)))]
        req += [(k.lower(), v) for k, v in (headers or {}).items()]
        conn.send_headers(sid, req, end_stream=False)
        sock.sendall(conn.data_to_send())
        # Respect the peer's flow-control window (Envoy's initial window is large; this only
        # matters for big bodies).
        sent = 0
        while sent < len(body):
            window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
            if window <= 0:
                _pump(sock, conn, H2Result(), sid)
                continue
            chunk = body[sent:sent + window]
            conn.send_data(sid, chunk, end_stream=not trailers and sent + len(chunk) == len(body))
            sent += len(chunk)
            sock.sendall(conn.data_to_send())
        if not body and not trailers:
            conn.end_stream(sid)
        if trailers:
            conn.send_headers(sid, [(k.lower(), v) for k, v in trailers.items()], end_stream=True)
        sock.sendall(conn.data_to_send())
        res = H2Result()
        while not _pump(sock, conn, res, sid):
            pass
        return res
    finally:
        sock.close()


def _pump(sock: socket.socket, conn: h2.connection.H2Connection, res: H2Result, sid: int) -> bool:
    """Reads what arrived; True once the response stream has ended."""
    data = sock.recv(65536)
    if not data:
        raise ConnectionError("connection closed before the response ended")
    done = False
    for ev in conn.receive_data(data):
        if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
            hs = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes)
                  else v for k, v in ev.headers}
            res.status = int(hs.get(":status", "0"))
            res.headers = hs
        elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
            res.body += ev.data
            conn.acknowledge_received_data(ev.flow_controlled_length, sid)
        elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)) and ev.stream_id == sid:
            done = True
    out = conn.data_to_send()
    if out:
        sock.sendall(out)
    return done
