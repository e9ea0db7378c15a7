"""The request bodies the OpenAI endpoint (``offstep.rollout.agents.openai_server``) accepts, checked with
pydantic; what is wrong becomes a 400 error object naming the parameter. Parameters that this
endpoint does not act on (``presence_penalty``, ``seed``, ``user``, ...) are accepted and ignored,
as OpenAI-compatible servers commonly do; those it cannot honour are refused (``stream`` of text
completions, ``tool_choice`` that forces a call, ``top_logprobs``)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 64
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An OpenAI error object: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict], None] = None
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"{v!r} is not one of {list(ROLES)}")
        return v


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    stop: Union[str, list[str], None] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("up to 4 non-empty strings")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def limit(self) -> Optional[int]:
        return self.max_tokens


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: Optional[list[dict]] = None
    tool_choice: Union[Literal["auto", "none"], None] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, le=0)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    stream: bool = False  # the whole answer in one chunk, once generated (see openai_server)
    stream_options: Optional[dict] = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        for i, t in enumerate(v or []):
            fn = t.get("function") if isinstance(t, dict) else None
            if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(
                    f"tool {i} is not {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
                )
        return v

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]]
    logprobs: Optional[int] = Field(None, ge=0, le=0)  # the sampled tokens' own log-probs; no alternatives
    stream: Literal[False] = False


def parse(model: type[BaseModel], body: Any):
    """``body`` as ``model``, or a 400 error object naming the first bad parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first["loc"])
        code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
        what = {
            "tool_choice": " (offstep does not constrain decoding: 'auto' or 'none')",
            "top_logprobs": " (only the sampled tokens' log-probs are returned)",
            "stream": " (text completions are not streamed; chat completions are)",
        }.get(param, "")
        raise APIError(400, f"{param}: {first['msg']}{what}", param, code) from None
