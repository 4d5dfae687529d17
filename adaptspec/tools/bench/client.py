"""A streaming /v1/completions client that keeps what latency accounting needs.

Standard library only. Each server-sent chunk is one engine step of the request (vLLM streams a
request's new tokens once per step), so the chunk times give time to first token and the gaps
between steps, and the tokens per chunk give the step's accepted drafts plus one.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any


class StreamResult:
    """Token ids, and per chunk its arrival time (s after sending) and token count."""

    __slots__ = ("tokens", "finish_reason", "error", "chunks", "seconds", "status",
                 "chunk_times", "chunk_tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.chunks = 0
        self.seconds = 0.0
        self.status = 0
        self.chunk_times: list[float] = []
        self.chunk_tokens: list[int] = []


def stream_completion(port: int, body: dict[str, Any], timeout: float = 120,
                      first_chunk: threading.Event | None = None,
                      stop_after_chunks: int | None = None,
                      host: str = "127.0.0.1") -> StreamResult:
    """POST a streaming /v1/completions request; collect token ids from its SSE chunks.

    `stop_after_chunks`: close the connection after that many chunks (a client that goes away).
    Never raises for server or network faults: they end up in `error`.
    """
    res = StreamResult()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        payload = json.dumps({**body, "stream": True, "return_token_ids": True}).encode()
        conn.request("POST", "/v1/completions", body=payload,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read()[:500]!r}"
            return res
        while True:
            line = resp.readline()
            if not line:
                if res.finish_reason is None:
                    res.error = "stream ended without a finish reason"
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                res.error = f"error event: {str(msg['error'])[:500]}"
                break
            n = 0
            for ch in msg.get("choices", []):
                ids = ch.get("token_ids") or []
                res.tokens.extend(ids)
                n += len(ids)
                if ch.get("finish_reason"):
                    res.finish_reason = ch["finish_reason"]
            res.chunks += 1
            if n:
                res.chunk_times.append(time.perf_counter() - t0)
                res.chunk_tokens.append(n)
            if first_chunk is not None and res.chunks == 1:
                first_chunk.set()
            if stop_after_chunks is not None and res.chunks >= stop_after_chunks:
                break
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        res.seconds = time.perf_counter() - t0
    return res
