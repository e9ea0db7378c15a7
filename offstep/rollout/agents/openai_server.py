"""An OpenAI-compatible HTTP endpoint on a rollout replica (FastAPI, served by uvicorn), for agents
written against the OpenAI API (``offstep.rollout.agents.openai_agent``; docs/openai-agents.md).

Routes: ``POST /v1/chat/completions`` (``tools`` and ``tool_choice``, calls parsed by the tool
parser of ``rollout.agent.format`` and returned as ``tool_calls``; ``n``, ``temperature``,
``top_p``, ``max_tokens``, ``stop``, ``logprobs``), ``POST /v1/completions`` and ``GET
/v1/models``; under ``/s/<session>/v1/...`` the calls are recorded into that rollout's session
(``offstep.rollout.agents.openai_record``). It listens on 127.0.0.1 only, on a port the OS picks, and
every request must carry the run's bearer token. Errors are OpenAI's error objects. The body's
size, the token and the connections' timeouts are checked in front of the app
(``offstep.rollout.agents.openai_limits``); a prompt and its ``max_tokens`` must fit the model's context.

Generation goes through the engine's ``generate`` only (``RolloutEngine``), on one thread of its
own: the requests that are waiting when the engine is free are generated together, grouped by
their sampling settings; a call that fails is split, so a request that fails fails alone. In
training, ``sampling`` fixes temperature, top-p and top-k to the run's (the trainer's log-probs
assume them); a request's own values are then ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from offstep.rollout.agents.openai_limits import Guard, Limits, check_context, context_length
from offstep.rollout.agents.openai_record import Choice, Session, render
from offstep.rollout.agents.openai_schema import APIError, ChatRequest, CompletionRequest, parse
from offstep.rollout.agents.tool_parsers import make_parser
from offstep.rollout.types import Completion, SamplingParams, check_request


class Batcher:
    """The engine's one caller while the endpoint serves: waiting requests go to ``generate``
    together, one call per distinct ``SamplingParams``. ``loop`` runs on the thread that owns the
    engine (the rollout worker's: vLLM's CPU kernels check the thread they run on) until ``stop``."""

    def __init__(self, engine, seed: int):
        self.engine, self.seed, self.batches = engine, seed, 0
        self.cond = threading.Condition()
        self.pending: list[tuple[list[int], SamplingParams, Future]] = []
        self.stopped = False
        self.error: BaseException | None = None  # the engine failed: the generation call fails too
        self.thread: threading.Thread | None = None

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        fut: Future = Future()
        with self.cond:
            if self.stopped:
                fut.set_exception(RuntimeError("the endpoint's engine has stopped"))
            else:
                self.pending.append((prompt, params, fut))
                self.cond.notify()
        return fut

    def loop(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.stopped:
                    self.cond.wait()
                if not self.pending:
                    return
                batch, self.pending = self.pending, []
            groups: dict[SamplingParams, list] = {}
            for item in batch:
                groups.setdefault(item[1], []).append(item)
            for params, items in groups.items():
                self._run(params, items)

    def _run(self, params: SamplingParams, items: list) -> None:
        """One ``generate`` for ``items``; if it fails, each half again, so that a request that
        fails fails alone and the requests batched with it are answered."""
        seed = self.seed + self.batches
        self.batches += 1
        try:
            out = self.engine.generate([p for p, _, _ in items], params, seed)
        except Exception as exc:  # noqa: BLE001 - answered to its own request
            if len(items) > 1:
                self._run(params, items[: len(items) // 2])
                self._run(params, items[len(items) // 2 :])
                return
            if not isinstance(exc, ValueError):  # the engine failed (a ValueError: the request's own fault)
                self.error = exc
            _settle(
                items[0][2],
                error=APIError(400, f"this request cannot be generated: {exc}", code="invalid_value")
                if isinstance(exc, ValueError)
                else exc,
            )
            return
        except BaseException as exc:  # noqa: BLE001 - an interrupt: every request of the call fails
            self.error = exc
            for _, _, fut in items:
                _settle(fut, error=exc)
            return
        for k, (_, _, fut) in enumerate(items):
            _settle(fut, out[k * params.n : (k + 1) * params.n])

    def start_thread(self) -> None:
        """Run ``loop`` on a thread of its own (an engine that any thread may drive)."""
        self.thread = threading.Thread(target=self.loop, name="openai-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """``loop`` returns once the requests already submitted are answered."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)


class OpenAIServer:
    """The endpoint of one replica: ``start`` serves, ``open_session``/``close_session`` bracket a
    rollout, ``close`` stops serving (the socket is closed)."""

    def __init__(
        self,
        engine,
        tokenizer,
        eos_ids,
        tool_format: str,
        budget: int,
        model_names: tuple[str, ...] = ("policy",),
        sampling: SamplingParams | None = None,
        seed: int = 0,
        token: str | None = None,
        limits: Limits | None = None,
    ):
        self.engine, self.tok, self.eos = engine, tokenizer, set(int(e) for e in eos_ids)
        self.tool_format, self.budget, self.model_names, self.sampling = tool_format, budget, model_names, sampling
        self.seed = seed
        self.token = token or secrets.token_urlsafe(32)
        self.limits = limits or Limits()
        self.context_len = self.limits.context_len or context_length(engine)
        self.guard = Guard(self.token, self.limits)
        self.sessions: dict[str, Session] = {}
        self.port = 0
        self._server = self._thread = self._sock = self.batcher = None

    # ---------------------------------------------------------------- lifecycle
    def start(self, engine_thread: bool = True, batcher=None) -> "OpenAIServer":
        """Serve. ``engine_thread=False``: the caller runs ``batcher.loop()`` on the engine's own thread.
        ``batcher``: another way to the engine (a streaming replica's feed: ``stream_agents.StreamBatcher``)."""
        import uvicorn

        self.batcher = batcher or Batcher(self.engine, self.seed)
        if engine_thread and batcher is None:
            self.batcher.start_thread()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))  # loopback only; the OS picks the port
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            self.guard.app(self.app()),
            http=self.guard.protocol(),
            ws="none",
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=self.limits.keep_alive_s,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="openai-endpoint", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the OpenAI endpoint did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._sock.close()
            self.batcher.stop()
            self._server = None

    def drive(self, work: Callable[[], Awaitable]) -> Any:
        """Run the coroutine ``work()`` (the agents) on a thread of its own while this thread, the
        engine's, generates what it asks for (after ``start(engine_thread=False)``); its result."""
        box: dict = {}

        def agents() -> None:
            try:
                box["out"] = asyncio.run(work())
            except BaseException as exc:  # noqa: BLE001 - raised below, on the engine's thread
                box["error"] = exc
            finally:
                self.batcher.stop()

        thread = threading.Thread(target=agents, name="openai-agents", daemon=True)
        thread.start()
        self.batcher.loop()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["out"]

    def base_url(self, session: str | None = None) -> str:
        where = f"/s/{session}" if session else ""
        return f"http://127.0.0.1:{self.port}{where}/v1"

    def open_session(self, budget: int | None = None) -> str:
        key = secrets.token_hex(8)
        self.sessions[key] = Session(self.budget if budget is None else budget)
        return key

    def close_session(self, key: str) -> Session:
        return self.sessions.pop(key)

    # ---------------------------------------------------------------- the app
    def app(self):
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def error(exc: APIError) -> JSONResponse:  # the token and the body's size: openai_limits.Guard, in front
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(APIError)
        async def api_error(request, exc: APIError):
            return error(exc)

        @app.exception_handler(RequestValidationError)
        async def invalid(request, exc: RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(x) for x in first.get("loc", ()) if x != "body"]
            if first.get("type") == "json_invalid":
                return error(APIError(400, "the request body is not valid JSON", code="invalid_json"))
            return error(
                APIError(
                    400,
                    f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}",
                    ".".join(loc) or None,
                    "invalid_value",
                )
            )

        @app.exception_handler(HTTPException)
        async def http_error(request, exc: HTTPException):
            codes = {404: "not_found", 405: "method_not_allowed"}
            return error(
                APIError(
                    exc.status_code,
                    f"{request.method} {request.url.path}: {exc.detail}",
                    code=codes.get(exc.status_code),
                )
            )

        @app.exception_handler(Exception)
        async def crashed(request, exc: Exception):
            return error(APIError(500, f"the endpoint failed: {type(exc).__name__}: {exc}", kind="server_error"))

        for prefix in ("/v1", "/s/{session}/v1"):
            app.add_api_route(prefix + "/models", self._models, methods=["GET"])
            app.add_api_route(prefix + "/chat/completions", self._chat, methods=["POST"])
            app.add_api_route(prefix + "/completions", self._completions, methods=["POST"])
        return app

    async def _models(self, session: str | None = None) -> dict:
        self._session(session)
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "offstep"} for m in self.model_names],
        }

    async def _chat(self, body: dict[str, Any], session: str | None = None):
        req: ChatRequest = parse(ChatRequest, body)
        sess = self._check(req.model, session)
        schemas = {t["function"]["name"]: t for t in req.tools or []}
        parser = make_parser(self.tool_format, schemas) if schemas and req.tool_choice != "none" else None
        try:
            prompt = render(
                self.tok, self.eos, [m.model_dump(exclude_none=True) for m in req.messages], req.tools, sess
            )
        except Exception as exc:  # noqa: BLE001 - the template refused these messages
            raise APIError(
                422,
                f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                "messages",
                "template_error",
            ) from exc
        extra_stop = parser.stop_strings() if parser else ()
        choices, left = await self._generate(prompt, req, sess, extra_stop, "messages")
        out = []
        for i, ch in enumerate(choices):
            text = _cut_stop(self.tok.decode(ch.ids, skip_special_tokens=True), req.stops())
            calls = parser.parse(self.tok.decode(ch.ids, skip_special_tokens=False)) if parser else []
            good = [c for c in calls if c.well_formed]
            ch.tool_calls, ch.attempts = len(good), len(calls)
            tool_calls = [
                {
                    "id": f"call_{secrets.token_hex(12)}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in good
            ]
            if sess is not None:
                sess.remember(text, tuple(t["id"] for t in tool_calls), ch)
            message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": tool_calls or None}
            out.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": "tool_calls" if tool_calls else ch.finish_reason,
                    "logprobs": {"content": self._token_logprobs(ch)} if req.logprobs else None,
                }
            )
        response = self._response("chat.completion", req.model, out, len(prompt), choices)
        return _streamed(response, (req.stream_options or {}).get("include_usage")) if req.stream else response

    async def _completions(self, body: dict[str, Any], session: str | None = None) -> dict:
        req: CompletionRequest = parse(CompletionRequest, body)
        sess = self._check(req.model, session)
        prompt = (
            req.prompt if isinstance(req.prompt, list) else self.tok(req.prompt, add_special_tokens=False)["input_ids"]
        )
        prompt = [int(t) for t in prompt]
        vocab = getattr(self.engine, "vocab_size", None) or len(self.tok)
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise APIError(
                400, f"prompt: empty, or a token id outside the vocabulary [0, {vocab})", "prompt", "invalid_value"
            )
        choices, _ = await self._generate(prompt, req, sess, (), "prompt")
        out = []
        for i, ch in enumerate(choices):
            lp = None
            if req.logprobs is not None:
                lp = {
                    "tokens": [self.tok.decode([t]) for t in ch.ids],
                    "token_logprobs": list(ch.logprobs),
                    "top_logprobs": None,
                    "text_offset": None,
                }
            out.append(
                {
                    "index": i,
                    "text": _cut_stop(self.tok.decode(ch.ids, skip_special_tokens=True), req.stops()),
                    "finish_reason": ch.finish_reason,
                    "logprobs": lp,
                    "token_ids": list(ch.ids),
                }
            )
        return self._response("text_completion", req.model, out, len(prompt), choices)

    # ---------------------------------------------------------------- helpers
    def _session(self, key: str | None) -> Session | None:
        if key is None:
            return None
        sess = self.sessions.get(key)
        if sess is None:
            raise APIError(
                404, f"no rollout session {key!r} on this endpoint (ended, or never opened)", code="session_not_found"
            )
        return sess

    def _check(self, model: str, key: str | None) -> Session | None:
        sess = self._session(key)
        if model not in self.model_names:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this endpoint serves {list(self.model_names)}",
                "model",
                "model_not_found",
            )
        return sess

    async def _generate(self, prompt: list[int], req, sess: Session | None, extra_stop: tuple[str, ...], param: str):
        """Sample ``req.n`` choices for ``prompt`` within the session's budget and the model's
        context (``max_tokens`` unset: cut to fit; set: refused if it does not); record them."""
        left = sess.budget_left(prompt) if sess is not None else self.budget
        limit = min(req.limit() or left, left)
        if self.context_len is not None and not req.limit():
            limit = min(limit, self.context_len - len(prompt))
        check_context(len(prompt), limit, self.context_len, param)
        if limit <= 0:  # the trajectory's response budget is spent: nothing is sampled
            if sess is not None:
                sess.cut = True
            return [Choice([], [], [], "length") for _ in range(req.n)], left
        params = SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_new_tokens=limit,
            stop=tuple(dict.fromkeys((*req.stops(), *extra_stop))),
        )
        if self.sampling is not None:  # training: the run's sampling, which the trainer's log-probs assume
            params = dataclasses.replace(
                params, temperature=self.sampling.temperature, top_p=self.sampling.top_p, top_k=self.sampling.top_k
            )
        try:  # here, not in the engine's batch, where it would fail the requests batched with it
            check_request([prompt], params, getattr(self.engine, "vocab_size", None) or len(self.tok))
        except ValueError as exc:
            raise APIError(400, f"{param}: {exc}", param, "invalid_value") from None
        completions: list[Completion] = await asyncio.wrap_future(self.batcher.submit(prompt, params))
        version = getattr(self.engine, "version", 0)
        choices = [
            Choice(
                list(c.response_ids),
                list(c.logprobs),
                list(c.versions) or [version] * len(c.response_ids),
                c.finish_reason,
            )
            for c in completions
        ]
        if sess is not None:
            sess.record(prompt, choices)
        return choices, left

    def _token_logprobs(self, ch: Choice) -> list[dict]:
        out = []
        for t, lp in zip(ch.ids, ch.logprobs):
            s = self.tok.decode([t])
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
        return out

    def _response(self, kind: str, model: str, choices: list[dict], prompt_len: int, sampled: list[Choice]) -> dict:
        n = sum(len(c.ids) for c in sampled)
        return {
            "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{secrets.token_hex(12)}",
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n},
        }


def _cut_stop(text: str, stops: tuple[str, ...]) -> str:
    """OpenAI's texts end before a stop string (the sampled ids keep it)."""
    for s in stops:
        if text.endswith(s):
            return text[: -len(s)]
    return text


def _streamed(response: dict, usage: bool):
    """A chat completion as server-sent events: each choice's whole message in one delta, then its
    finish reason, (the usage,) ``[DONE]``. Generation is not incremental, only its delivery."""
    from fastapi.responses import StreamingResponse

    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    events = []
    for c in response["choices"]:
        m = c["message"]
        delta = {"role": "assistant", "content": m["content"]}
        if m["tool_calls"]:
            delta["tool_calls"] = [{"index": k, **t} for k, t in enumerate(m["tool_calls"])]
        events.append(
            {
                **head,
                "choices": [{"index": c["index"], "delta": delta, "finish_reason": None, "logprobs": c["logprobs"]}],
            }
        )
        events.append({**head, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]})
    if usage:
        events.append({**head, "choices": [], "usage": response["usage"]})

    async def body():
        for e in events:
            yield f"data: {json.dumps(e)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _settle(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Answer ``fut``, unless its caller gave up on it (which must not stop the engine's loop)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass
