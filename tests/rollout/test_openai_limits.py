"""The OpenAI endpoint's limits (offstep.rollout.agents.openai_limits, openai_server), each attack of the
audit as a test: a body over the size limit is a 413 before it is read (the process's memory does
not grow with it), a prompt longer than the model's context is a 400 before anything is
generated, connections that hold a socket without sending their headers and the token are closed,
and a request that fails in a batch fails alone. A tiny model built in code; no Ray."""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import threading
import time

import httpx
import psutil
import pytest
from test_openai_endpoint import USER, parts  # noqa: F401 - the tiny scripted model's fixture

from offstep.rollout.agents.openai_limits import Limits, check_context, context_length
from offstep.rollout.agents.openai_schema import APIError
from offstep.rollout.agents.openai_server import OpenAIServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MB = 1 << 20
QUICK = Limits(max_body_bytes=MB, header_timeout_s=0.5, keep_alive_s=0.5, max_pending=10, evict_after_s=0.1)


class Poisoned:
    """The real engine, whose ``generate`` fails for any call that holds the token ``POISON`` (an
    exception in one request's own processing), holds its first call until ``release`` is set, and
    records the size of every call."""

    POISON = 499

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.inside, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, seed, on_finish=None):
        self.calls.append(len(prompts))
        if len(self.calls) == 1:
            self.inside.set()
            assert self.release.wait(30)
        if any(self.POISON in p for p in prompts):
            raise RuntimeError("poisoned prompt")
        return self.engine.generate(prompts, params, seed, on_finish)


@pytest.fixture
def server(parts):
    tok, eos, engine = parts
    spy = Poisoned(engine)
    spy.release.set()
    srv = OpenAIServer(spy, tok, eos, "tag", budget=10_000, limits=QUICK).start()
    yield srv, spy
    srv.close()


def _auth(srv) -> dict:
    return {"Authorization": f"Bearer {srv.token}"}


def _connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    return s


def _head(srv, extra: str, path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {srv.token}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def _response(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        part = s.recv(65536)
        assert part, f"the connection closed after {data!r}"
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[: _length(data)])


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def _send_until_answered(s: socket.socket, chunks, most: int) -> int:
    """Send ``chunks`` until the server answers (or ``most`` bytes went); the bytes sent."""
    sent = 0
    for chunk in chunks:
        if select.select([s], [], [], 0)[0] or sent >= most:
            break
        s.sendall(chunk)
        sent += len(chunk)
    return sent


def _rss() -> int:
    return psutil.Process().memory_info().rss


# ------------------------------------------------------------------ the body's size


def test_a_declared_body_over_the_limit_is_a_413_before_it_is_read(server):
    """200 MB announced: answered at the headers; what follows is discarded, not kept."""
    srv, spy = server
    chunk = b"x" * MB
    before = _rss()
    with _connect(srv) as s:
        s.sendall(_head(srv, f"Content-Length: {200 * MB}\r\n"))
        sent = _send_until_answered(s, iter(lambda: chunk, None), 64 * MB)
        status, body = _response(s)
    assert status == 413 and sent < 16 * MB, (status, sent)
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "request_too_large"
    assert _rss() - before < 32 * MB and spy.calls == []


def test_a_chunked_body_is_refused_once_it_grows_past_the_limit(server):
    srv, spy = server
    piece = b"y" * (256 << 10)
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    before = _rss()
    with _connect(srv) as s:
        s.sendall(_head(srv, "Transfer-Encoding: chunked\r\n"))
        sent = _send_until_answered(s, iter(lambda: chunk, None), 64 * MB)
        status, body = _response(s)
    assert status == 413 and sent < 8 * MB and body["error"]["code"] == "request_too_large", (status, sent)
    assert _rss() - before < 32 * MB and spy.calls == []


def test_a_body_within_the_limit_is_served(server):
    """Half the limit (in a parameter the endpoint ignores) is read, handed on whole and answered."""
    srv, spy = server
    with httpx.Client(timeout=30) as http:
        resp = http.post(
            srv.base_url() + "/chat/completions",
            headers=_auth(srv),
            json={"model": "policy", "messages": USER, "max_tokens": 2, "metadata": {"pad": "a" * (MB // 2)}},
        )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1 and spy.calls == [1]


# ------------------------------------------------------------------ the context length


def test_an_over_long_prompt_is_a_400_before_any_generation(server):
    srv, spy = server
    assert srv.context_len == 2048 == context_length(spy)  # the tiny model's max_position_embeddings
    long = [{"role": "user", "content": "word " * 3000}]
    chat, text = srv.base_url() + "/chat/completions", srv.base_url() + "/completions"
    with httpx.Client(timeout=30) as http:
        t0 = time.monotonic()
        resp = http.post(chat, headers=_auth(srv), json={"model": "policy", "messages": long})
        took = time.monotonic() - t0
        err = resp.json()["error"]
        assert resp.status_code == 400 and (err["param"], err["code"]) == ("messages", "context_length_exceeded")
        assert "maximum context length is 2048 tokens" in err["message"] and took < 2
        # a short prompt whose max_tokens does not fit: refused too; unset, it is cut to fit
        resp = http.post(chat, headers=_auth(srv), json={"model": "policy", "messages": USER, "max_tokens": 3000})
        assert resp.status_code == 400 and "in the completion" in resp.json()["error"]["message"]
        resp = http.post(text, headers=_auth(srv), json={"model": "policy", "prompt": [5] * 2048, "max_tokens": 1})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert spy.calls == []  # nothing reached the engine


def test_check_context_in_openais_words():
    check_context(2000, 48, 2048, "messages")
    check_context(10, 5000, None, "messages")  # no known context: nothing refused
    with pytest.raises(APIError) as err:
        check_context(2000, 100, 2048, "messages")
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert "you requested 2100 tokens (2000 in the messages, 100 in the completion)" in err.value.message
    with pytest.raises(APIError, match="your prompt resulted in 2048 tokens"):
        check_context(2048, 0, 2048, "prompt")


# ------------------------------------------------------------------ connections


def _closed_by_server(socks: list[socket.socket], within: float) -> int:
    """How many of ``socks`` the server closes within ``within`` seconds (reading any response first)."""
    deadline, open_ = time.monotonic() + within, list(socks)
    while open_ and time.monotonic() < deadline:
        for s in select.select(open_, [], [], max(0.0, deadline - time.monotonic()))[0]:
            try:
                if s.recv(65536):
                    continue  # a response (a 401) before the close
            except ConnectionResetError:
                pass
            open_.remove(s)
    return len(socks) - len(open_)


@pytest.mark.heavy  # waits for the timeouts
def test_half_open_connections_are_closed_within_the_header_timeout(server):
    """100 sockets that send nothing, part of their headers, or a request with a wrong token: all
    closed by the server within QUICK.header_timeout_s (0.5 s) and some slack."""
    srv, _ = server
    socks = [_connect(srv) for _ in range(100)]
    for k, s in enumerate(socks):
        if k % 3 == 1:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        elif k % 3 == 2:  # whole requests, the wrong token: a 401 each, and the deadline stands
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer wrong\r\n\r\n")
    assert _closed_by_server(socks, 3.0) == 100
    for s in socks:
        s.close()
    # the endpoint still serves
    with httpx.Client(timeout=30) as http:
        assert http.get(srv.base_url() + "/models", headers=_auth(srv)).status_code == 200


@pytest.mark.heavy  # waits for the timeouts
def test_a_trusted_connection_idles_out_and_owes_each_request_its_headers(server):
    srv, _ = server
    get = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {srv.token}\r\n\r\n".encode()
    with _connect(srv) as s:  # served, then idle: closed after keep_alive_s
        s.sendall(get)
        assert _response(s)[0] == 200
        assert _closed_by_server([s], 2.0) == 1
    with _connect(srv) as s:  # served, then half a request: closed after header_timeout_s
        s.sendall(get)
        assert _response(s)[0] == 200
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _closed_by_server([s], 2.0) == 1
    with _connect(srv) as s:  # served within the time: kept for the next request
        for _ in range(3):
            s.sendall(get)
            assert _response(s)[0] == 200
            time.sleep(0.3)


@pytest.mark.heavy  # waits past evict_after_s
def test_connections_without_the_token_are_bounded(parts):
    """Past max_pending (10) connections that have not shown the token, the oldest are closed as
    soon as they have waited evict_after_s, long before the header timeout; a client with the
    token is served."""
    tok, eos, engine = parts
    srv = OpenAIServer(
        engine, tok, eos, "tag", budget=8, limits=Limits(header_timeout_s=30, max_pending=10, evict_after_s=0.1)
    ).start()
    try:
        idle = [_connect(srv) for _ in range(40)]
        time.sleep(0.2)
        late = _connect(srv)  # 41 waiting: the 31 oldest go
        assert _closed_by_server(idle, 0.3) == 31 and len(srv.guard.pending) == 10
        with httpx.Client(timeout=30) as http:
            assert http.get(srv.base_url() + "/models", headers=_auth(srv)).status_code == 200
        for s in (*idle, late):
            s.close()
    finally:
        srv.close()


# ------------------------------------------------------------------ one bad request


@pytest.mark.heavy  # tiny-model generation
def test_one_bad_request_fails_alone_in_its_batch(parts):
    """Four good requests and a poisoned one, batched together in one generate: the four are
    answered, the poisoned one gets its own 500 error object. A NaN temperature sent beside them
    is refused on its own, before any batch."""
    tok, eos, engine = parts
    spy = Poisoned(engine)
    srv = OpenAIServer(spy, tok, eos, "tag", budget=40, limits=QUICK).start()
    try:

        async def call(http, prompt):
            return await http.post(
                srv.base_url() + "/completions",
                headers=_auth(srv),
                json={"model": "policy", "prompt": prompt, "max_tokens": 3, "temperature": 0},
            )

        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                first = asyncio.create_task(call(http, [1, 67, 201]))  # holds the engine...
                while not spy.inside.is_set():
                    await asyncio.sleep(0.01)
                prompts = [[1, 67, 201], [1, 30], [1, Poisoned.POISON, 5], [1, 90], [1, 32, 23]]
                rest = [asyncio.create_task(call(http, p)) for p in prompts]
                nan = await http.post(
                    srv.base_url() + "/completions",
                    headers={**_auth(srv), "Content-Type": "application/json"},
                    content=b'{"model": "policy", "prompt": [1, 30], "temperature": NaN}',
                )
                assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
                while len(srv.batcher.pending) < len(prompts):  # ...until the five wait together
                    await asyncio.sleep(0.01)
                spy.release.set()
                return await first, await asyncio.gather(*rest)

        first, rest = asyncio.run(main())
    finally:
        srv.close()
    assert spy.calls[:2] == [1, 5]  # the five went to the engine in one call
    assert first.status_code == 200
    for k, resp in enumerate(rest):
        if k == 2:
            err = resp.json()["error"]
            assert resp.status_code == 500 and err["type"] == "server_error" and "poisoned prompt" in err["message"]
        else:
            assert resp.status_code == 200 and len(resp.json()["choices"][0]["token_ids"]) >= 1, resp.text
    assert isinstance(srv.batcher.error, RuntimeError)  # a training run still stops on an engine failure
