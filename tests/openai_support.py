"""What the OpenAI meter's tests share: an OpenAI-shaped server written here (the upstream whose
every answer the test controls), servers on loopback in a thread, the proxy in a thread, and
images as data URLs."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from typing import Any, Literal

import httpx
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mrc_agent.agent.tools.proxy import Proxy, Upstream
from mrc_agent.exporters.instrumentation import MRCMetrics


def data_url(width: int, height: int, fmt: str = "PNG") -> str:
    """A ``data:`` URL of a ``width`` x ``height`` image (one colour: small whatever its size)."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (30, 60, 90)).save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


#: A 640x480 PNG: the <1MP cell.
SMALL_PNG = data_url(640, 480)


def chat(text: str, *urls: str, stream: bool = False, usage: bool = True,
         **extra: Any) -> dict[str, Any]:
    """A chat completions request: one user message, ``text`` then the images."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": parts}],
                            "stream": stream, **extra}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


class FakeEngine:
    """An OpenAI-compatible server's answers, written by hand. ``words`` content events per
    answer, ``prompt_tokens`` fixed; a request's ``"x_fail"`` asks for a failure:
    ``"status"`` (400 before any byte), ``"midstream"`` (the connection dies after the first
    event), ``"slow"`` (an event every 50 ms for 10 s, or ``"x_slow_events"`` of them, recording
    whether the client left)."""

    def __init__(self, words: int = 3, prompt_tokens: int = 11) -> None:
        self.words = words
        self.prompt_tokens = prompt_tokens
        self.disconnected = threading.Event()
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._chat, methods=["POST"]),
            Route("/echo", self._echo, methods=["POST", "PUT"]),
        ])

    async def _echo(self, request: Request) -> Response:
        self.headers.append(dict(request.headers))
        return Response(await request.body(), media_type="application/octet-stream")

    async def _chat(self, request: Request) -> Response:
        raw = await request.body()
        self.bodies.append(raw)
        self.headers.append(dict(request.headers))
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return JSONResponse({"error": {"message": "bad JSON", "type": "invalid_request_error",
                                           "param": None, "code": 400}}, status_code=400)
        fail = body.get("x_fail")
        if fail == "status":
            return JSONResponse({"error": {"message": "refused"}}, status_code=400)
        n = int(body.get("max_tokens") or self.words)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                 "total_tokens": self.prompt_tokens + n}
        if not body.get("stream"):
            return JSONResponse({"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "w " * n},
                 "finish_reason": "length"}], "usage": usage})
        want_usage = (body.get("stream_options") or {}).get("include_usage")

        async def events() -> Any:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                            "content": ""}}]})
            if fail == "slow":
                try:
                    for _ in range(int(body.get("x_slow_events", 200))):
                        yield _sse({"choices": [{"index": 0, "delta": {"content": "w"}}]})
                        await asyncio.sleep(0.05)
                finally:
                    self.disconnected.set()
                return
            for i in range(n):
                await asyncio.sleep(0.002)
                yield _sse({"choices": [{"index": 0, "delta": {"content": f"w{i}"}}]})
                if fail == "midstream":
                    raise RuntimeError("the engine died")
            yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if want_usage:
                yield _sse({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class ServerThread:
    """An ASGI app on a real uvicorn server on 127.0.0.1, in a thread of this process."""

    def __init__(self, app: Any, lifespan: Literal["on", "off"] = "off") -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical",
                                access_log=False, lifespan=lifespan)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 240  # an app's startup may build a model
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        self.port = int(self.server.servers[0].sockets[0].getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class ProxyThread:
    """``mrc-agent proxy``'s server on its own event loop in a thread, on a free port."""

    def __init__(self, upstream: str, metrics: MRCMetrics | None = None,
                 connect_timeout: float = 5.0, **options: Any) -> None:
        self.metrics = metrics or MRCMetrics(resolution_unknown=True)
        self.proxy = Proxy(Upstream.parse(upstream), self.metrics,
                           connect_timeout=connect_timeout, **options)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        ports: list[int] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            ports.append(self.loop.run_until_complete(self.proxy.start("127.0.0.1", 0)))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)
        self.url = f"http://127.0.0.1:{ports[0]}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def send_chat(sock: socket.socket, body: dict[str, Any]) -> None:
    """Write a chat completions request for ``body`` on a raw socket (the test owns the
    connection: to leave mid-answer, or to read nothing)."""
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(raw)).encode()
                 + b"\r\n\r\n" + raw)


def leave_after(url: str, body: dict[str, Any], seen: bytes = b"data: ") -> None:
    """Send ``body`` to ``url``, read until ``seen`` arrives, then close the connection: a
    client that leaves mid-stream."""
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
        send_chat(sock, body)
        got = b""
        while seen not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk


def stream_lines(url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """POST ``body`` and read the answer's lines as they come: (status, lines)."""
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        return r.status_code, list(r.iter_lines())
