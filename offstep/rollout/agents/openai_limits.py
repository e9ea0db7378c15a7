"""What the OpenAI endpoint (``offstep.rollout.agents.openai_server``) refuses before a request reaches it:
a body over a size limit (413, answered from its ``Content-Length`` before anything is read, or as
soon as a chunked body grows past the limit), a missing or wrong token (401), and connections that
hold a socket without sending their headers and the token within a few seconds (closed).

uvicorn has an idle keep-alive timeout (``keep_alive_s``) but no timeout on headers and no bound on
connections that have not shown the token, so the endpoint serves with a subclass of uvicorn's
HTTP protocol (``Guard.protocol``) that adds them, and behind an ASGI gate (``Guard.app``) that
checks the token and the body's size. Also here: the model's context length, which a prompt and
its ``max_tokens`` must fit (``context_length``, ``check_context``)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from offstep.rollout.agents.openai_schema import APIError


@dataclass(frozen=True)
class Limits:
    """The endpoint's limits. The defaults fit any legitimate chat: 8 MiB of JSON is more than
    a 128k-token conversation, with its tools, escaped."""

    max_body_bytes: int = 8 << 20
    # from connecting (once trusted: from a request's first byte) to its headers, with the token
    header_timeout_s: float = 5.0
    # an idle connection closes: longer than httpx's 5 s, so that clients drop theirs first
    keep_alive_s: float = 20.0
    # connections that have not shown the token, kept at most, by closing the oldest of those that
    # waited evict_after_s (a burst of agents connecting at once is spared)
    max_pending: int = 256
    evict_after_s: float = 1.0
    # prompt and completion tokens at most; None: the engine's model's (context_length)
    context_len: int | None = None


def context_length(engine: Any) -> int | None:
    """The most tokens, prompt and completion together, the engine's model takes: vLLM's
    ``max_model_len``, or the built-in engine's model's ``max_position_embeddings`` (None: unknown)."""
    vllm_config = getattr(getattr(getattr(engine, "llm", None), "llm_engine", None), "model_config", None)
    hf_config = getattr(getattr(engine, "model", None), "config", None)
    for where, name in ((vllm_config, "max_model_len"), (hf_config, "max_position_embeddings")):
        n = getattr(where, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def check_context(prompt_len: int, completion: int, context: int | None, param: str) -> None:
    """A 400 in OpenAI's words when ``prompt_len`` tokens and ``completion`` more do not fit."""
    if context is None or prompt_len + max(completion, 0) <= context and prompt_len < context:
        return
    where = "messages" if param == "messages" else "prompt"
    asked = (
        f"you requested {prompt_len + completion} tokens ({prompt_len} in the {where}, {completion} in the completion)"
        if completion > 0
        else f"your {where} resulted in {prompt_len} tokens"
    )
    raise APIError(
        400,
        f"This model's maximum context length is {context} tokens. However, {asked}. Please reduce "
        f"the length of the {where}{' or completion' if completion > 0 else ''}.",
        param,
        "context_length_exceeded",
    )


class Guard:
    """One endpoint's gate: its token, its limits, and its connections that have not shown the
    token yet (oldest first, with when they connected)."""

    def __init__(self, token: str, limits: Limits):
        self.expected, self.limits = f"Bearer {token}".encode(), limits
        self.pending: dict[Any, float] = {}

    def authorized(self, scope: dict) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return secrets.compare_digest(given, self.expected)

    def admit(self, conn: Any) -> None:
        """Count a new connection; past ``max_pending``, close the oldest that waited long enough."""
        now = time.monotonic()
        self.pending[conn] = now
        while len(self.pending) > self.limits.max_pending:
            oldest, since = next(iter(self.pending.items()))
            if now - since < self.limits.evict_after_s:
                break
            del self.pending[oldest]
            oldest.close_now()

    def app(self, inner):
        """``inner`` (an ASGI app) behind the token and the body limit."""
        return _Gate(inner, self)

    def protocol(self) -> type:
        """uvicorn's HTTP protocol (httptools, or h11 without it) with this guard's timeouts."""
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        return type("GuardedHTTPProtocol", (_Guarded, AutoHTTPProtocol), {"guard": self})


class _Gate:
    def __init__(self, inner, guard: Guard):
        self.inner, self.guard = inner, guard

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        if not self.guard.authorized(scope):
            return await answer(
                send,
                APIError(
                    401,
                    "missing or wrong API key: pass the run's token as 'Authorization: Bearer <token>'",
                    code="invalid_api_key",
                ),
            )
        limit = self.guard.limits.max_body_bytes
        too_large = APIError(
            413, f"the request body is larger than this endpoint's limit of {limit} bytes", code="request_too_large"
        )
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await answer(send, too_large)  # nothing read: the server discards the rest
        chunks, size, more = [], 0, True
        while more:  # read here, within the limit, then handed on whole
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await answer(send, too_large)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, given = b"".join(chunks), False

        async def replay():
            nonlocal given
            if given:
                return await receive()  # after the body: only the client's disconnect
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.inner(scope, replay, send)


async def answer(send, exc: APIError) -> None:
    """``exc`` as a whole HTTP response, from ASGI."""
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Guarded:
    """Mixed into uvicorn's HTTP protocol: a connection must send its headers, with the token,
    within ``header_timeout_s`` of connecting or it is closed (a request with a wrong token is
    answered 401, and the deadline stands); once trusted, each request's headers are due within
    ``header_timeout_s`` of its first byte. Idle connections are uvicorn's keep-alive timeout's."""

    guard: Guard  # set on the subclass made for one endpoint (Guard.protocol)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._trusted = False
        inner = self.app  # the protocol calls it once a request's headers are in

        async def app(scope, receive, send):
            self._headers_in(scope)
            await inner(scope, receive, send)

        self.app = app

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()
        self.guard.admit(self)

    def data_received(self, data: bytes) -> None:
        cycle = getattr(self, "cycle", None)
        if self._timer is None and (cycle is None or cycle.response_complete):
            self._arm()  # a new request (or the rest of a refused body) begins
        super().data_received(data)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.guard.pending.pop(self, None)
        super().connection_lost(exc)

    def close_now(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _headers_in(self, scope: dict) -> None:
        if self._trusted or self.guard.authorized(scope):
            self._trusted = True
            self.guard.pending.pop(self, None)
            self._disarm()

    def _arm(self) -> None:
        self._timer = self.loop.call_later(self.guard.limits.header_timeout_s, self.close_now)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
