"""An OpenAI-style completions client for the tests and the benchmark, with timings.

Prompts are token ids (`"prompt": [ids...]`), which the simulated replicas and vLLM both accept, so
a test controls exactly which KV blocks two requests share. Times are measured on the client:
`ttfb_s` from sending the request to the first byte of the response body (for a stream, the first
event), `total_s` to the last byte.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import dataclass, field

REPLICA_HEADER = "x-kvsteer-replica"


@dataclass
class Result:
    status: int
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    events: int = 0
    done: bool = False
    ttfb_s: float = 0.0
    total_s: float = 0.0
    error: str = ""
    headers: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


WORDS = ("routing tokens cache replica prefill decode block hash session agent tool result "
         "context window engine").split()


def prose(seed: int, words: int) -> str:
    """`words` made-up words led by `[seed]`: equal seeds give equal text, distinct seeds distinct
    text (a text prompt's counterpart of `tokens`)."""
    x = seed * 2654435761 % 2**32 or 1
    out = [f"[{seed}]"]
    for _ in range(words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(WORDS[x % len(WORDS)])
    return " ".join(out)


def tokens(n: int, seed: int) -> list[int]:
    """`n` token ids drawn from `seed`: equal seeds give equal prompts, distinct seeds distinct ones."""
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(n)]


class Client:
    """One keep-alive HTTP/1.1 connection to `host:port` (reopened after errors)."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        return self.conn

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, dict, bytes]:
        conn = self._connection()
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        except Exception:
            self.close()
            raise

    def complete(
        self,
        prompt: list[int],
        max_tokens: int = 4,
        stream: bool = False,
        session: str | None = None,
        headers: dict | None = None,
        chat: bool = False,
        extra: dict | None = None,
        ignore_eos: bool = False,
    ) -> Result:
        """POST one completion; never raises for a failed request (the error is in the result)."""
        body: dict = {"model": "sim", "max_tokens": max_tokens, "stream": stream}
        if chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": " ".join(map(str, prompt))}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        if ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(extra or {})
        h = {"content-type": "application/json"}
        if session is not None:
            h["x-session-id"] = session
        h.update(headers or {})
        payload = json.dumps(body).encode()
        conn = self._connection()
        t0 = time.perf_counter()
        try:
            conn.request("POST", path, body=payload, headers=h)
            resp = conn.getresponse()
            res = Result(status=resp.status)
            res.headers = {k.lower(): v for k, v in resp.getheaders()}
            res.replica = res.headers.get(REPLICA_HEADER, "")
            first = resp.read1(65536) if not resp.closed else b""
            res.ttfb_s = time.perf_counter() - t0
            chunks = [first]
            while not resp.isclosed():
                b = resp.read1(65536)
                if not b:
                    # read1 leaves a fully read fixed-length response open; read() marks it done
                    # so the connection can carry the next request.
                    chunks.append(resp.read())
                    break
                chunks.append(b)
            res.total_s = time.perf_counter() - t0
            data = b"".join(chunks)
            if resp.will_close:
                self.close()
        except Exception as e:  # a reset, a refused connection, a timeout
            self.close()
            return Result(status=0, error=f"{type(e).__name__}: {e}",
                          total_s=time.perf_counter() - t0)
        if res.status != 200:
            res.error = data[:300].decode(errors="replace")
            return res
        try:
            if stream:
                _read_stream(res, data)
            else:
                _read_json(res, json.loads(data))
        except (ValueError, KeyError, TypeError) as e:
            res.error = f"unreadable answer: {e}: {data[:200]!r}"
        return res



def chat_completion(port: int, messages: list[dict], model: str = "sim",
                    max_tokens: int = 8) -> dict:
    """One chat completion, not streamed, on a fresh connection to 127.0.0.1:`port` (so any of the
    proxy's workers may route it): the JSON answer, with the replica that answered (its
    `REPLICA_HEADER`) under `_replica`. Raises AssertionError on a status other than 200."""
    c = Client("127.0.0.1", port)
    try:
        body = json.dumps({"model": model, "max_tokens": max_tokens,
                           "messages": messages}).encode()
        status, headers, data = c.request(
            "POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    finally:
        c.close()
    if status != 200:
        raise AssertionError(f"status {status}: {data[:300]!r}")
    doc = json.loads(data)
    doc["_replica"] = headers.get(REPLICA_HEADER, "")
    return doc


def cached_tokens(doc: dict) -> int:
    """The prompt tokens an OpenAI-shaped answer says came from the engine's cache (0 if unsaid)."""
    return ((doc.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0

def _usage(res: Result, usage: dict | None) -> None:
    if not usage:
        return
    res.prompt_tokens = usage.get("prompt_tokens", 0) or 0
    res.completion_tokens = usage.get("completion_tokens", 0) or 0
    details = usage.get("prompt_tokens_details") or {}
    res.cached_tokens = details.get("cached_tokens", 0) or 0


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    msg = choice.get("message") or choice.get("delta") or {}
    return msg.get("content") or ""


def _read_json(res: Result, doc: dict) -> None:
    res.text = "".join(_choice_text(c) for c in doc.get("choices", []))
    _usage(res, doc.get("usage"))
    res.done = True


def _read_stream(res: Result, data: bytes) -> None:
    """Server-sent events: `data: {json}` lines, closed by `data: [DONE]`."""
    parts = []
    for line in data.decode().splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            res.done = True
            continue
        doc = json.loads(payload)
        if "error" in doc:
            res.error = f"error event: {doc['error']}"
            continue
        res.events += 1
        parts.extend(_choice_text(c) for c in doc.get("choices", []))
        if doc.get("usage"):
            _usage(res, doc["usage"])
    res.text = "".join(parts)
    if not res.done and not res.error:
        res.error = "stream ended without [DONE]"
