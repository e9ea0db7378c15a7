"""What the OpenAI endpoint (``offstep.rollout.agents.openai_server``) records of one rollout, and the
sample it becomes: token for token, nothing decoded and re-tokenized.

Rendering. A chat request's messages go through the chat template, except the assistant messages
this session's endpoint returned itself (matched by their content and tool-call ids): each of
those is rendered as a placeholder, and the placeholder is replaced by the token ids that were
sampled for it. So a follow-up call's prompt is the earlier prompt, the sampled tokens, then the
template's text for the tool results and the next assistant header tokenized on its own, exactly
as the agent loop frames a tool turn (``agent_loop.ToolTurnRenderer``).

Trajectories. Every sampled choice is a node (its prompt and its tokens). A call whose prompt
starts with a node's prompt and tokens continues that node (the longest such). A call that
continues none after the first call is a *prefix break* (the agent edited or dropped history, or
rendered messages the endpoint did not return): it starts a new trajectory. The rollout's sample
is the trajectory of its last call, choice 0, from its root: the model's tokens trained, the
tokens between calls (tool results, user turns) masked as tool turns are; calls off that
trajectory are not trained, and the breaks are counted (``agent/prefix_breaks``). Keeping one
sample per rollout keeps the group of ``rollout.n`` rollouts per prompt whole.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from offstep.batch import NO_VERSION

PLACEHOLDER = "OFFSTEP_SAMPLED_TURN_{}_PLACEHOLDER"


@dataclass
class Choice:
    """One sampled completion: its tokens exactly as the engine returned them."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    tool_calls: int = 0  # well-formed calls parsed from it
    attempts: int = 0  # call attempts, well-formed or not


@dataclass
class Call:
    prompt_ids: list[int]
    choices: list[Choice]
    parent: tuple[int, int] | None = None  # (call, choice) it continues; None: a root


@dataclass
class Trajectory:
    """A rollout's sample: ``loss_mask`` 1 on sampled tokens, 0 (log-prob 0.0) on those between calls."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0
    tool_calls: int = 0
    attempts: int = 0


class Session:
    """One rollout's calls, in the order they were answered (thread-safe)."""

    def __init__(self, budget: int):
        self.budget = budget  # response tokens of a trajectory at most (rollout.max_new_tokens)
        self.calls: list[Call] = []
        self.returned: dict[tuple, Choice] = {}  # (content, tool-call ids) -> the choice returned with them
        self.breaks = 0
        self.cut = False  # a call found the budget spent
        self.lock = threading.Lock()

    def parent_of(self, prompt: list[int]) -> tuple[int, int] | None:
        """The node whose prompt and tokens are the longest prefix of ``prompt``."""
        best, best_len = None, -1
        for ci, call in enumerate(self.calls):
            for k, ch in enumerate(call.choices):
                n = len(call.prompt_ids) + len(ch.ids)
                if (
                    n > best_len
                    and n <= len(prompt)
                    and prompt[: len(call.prompt_ids)] == call.prompt_ids
                    and prompt[len(call.prompt_ids) : n] == ch.ids
                ):
                    best, best_len = (ci, k), n
        return best

    def root_len(self, parent: tuple[int, int] | None) -> int | None:
        while parent is not None:
            call = self.calls[parent[0]]
            if call.parent is None:
                return len(call.prompt_ids)
            parent = call.parent
        return None

    def budget_left(self, prompt: list[int]) -> int:
        """Tokens the call may sample: the budget less what its trajectory already holds."""
        with self.lock:
            root = self.root_len(self.parent_of(prompt))
        return self.budget - (len(prompt) - root if root is not None else 0)

    def record(self, prompt: list[int], choices: list[Choice]) -> None:
        with self.lock:
            parent = self.parent_of(prompt)
            if parent is None and self.calls:
                self.breaks += 1
            self.calls.append(Call(list(prompt), choices, parent))

    def remember(self, content: str, call_ids: tuple[str, ...], choice: Choice) -> None:
        with self.lock:
            self.returned[(content, call_ids)] = choice

    def lookup(self, message: dict) -> Choice | None:
        if message.get("role") != "assistant":
            return None
        ids = tuple(str(c.get("id")) for c in message.get("tool_calls") or [])
        with self.lock:
            return self.returned.get((text_of(message.get("content")), ids))

    def trajectory(self) -> Trajectory | None:
        """The sample: the trajectory ending at the last call's first choice (None: no call)."""
        with self.lock:
            if not self.calls:
                return None
            chain, node = [], (len(self.calls) - 1, 0)
            while node is not None:
                chain.append(node)
                node = self.calls[node[0]].parent
            chain.reverse()
            root = self.calls[chain[0][0]]
            t = Trajectory(list(root.prompt_ids))
            for ci, k in chain:
                call, ch = self.calls[ci], self.calls[ci].choices[k]
                between = call.prompt_ids[len(t.prompt_ids) + len(t.response_ids) :]
                t.response_ids += between + ch.ids
                t.logprobs += [0.0] * len(between) + ch.logprobs
                t.loss_mask += [0] * len(between) + [1] * len(ch.ids)
                first = ch.versions[0] if ch.versions else 0
                t.versions += [NO_VERSION] * len(between) + list(ch.versions or [first] * len(ch.ids))
                t.turns += 1
                t.tool_calls += ch.tool_calls
                t.attempts += ch.attempts
                t.finish_reason = ch.finish_reason
            if self.cut:
                t.finish_reason = "length"
            return t


def text_of(content: Any) -> str:
    """A message's content as one string (OpenAI's list of text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _template_message(m: dict) -> dict:
    """A message as chat templates read it: text content, tool-call arguments as objects."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = text_of(m.get("content"))
    calls = []
    for c in m.get("tool_calls") or []:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass
        calls.append({**c, "function": fn})
    if calls:
        out["tool_calls"] = calls
    return out


def render(
    tokenizer: Any, eos_ids: set[int], messages: list[dict], tools: list[dict] | None, session: Session | None
) -> list[int]:
    """The prompt ids of a chat request: the template's text tokenized, with the session's own
    sampled turns spliced in as their token ids (see the module's docstring)."""
    spliced: list[Choice] = []
    msgs = []
    for m in messages:
        choice = session.lookup(m) if session is not None else None
        if choice is None:
            msgs.append(_template_message(m))
        else:
            msgs.append({"role": "assistant", "content": PLACEHOLDER.format(len(spliced))})
            spliced.append(choice)
    kwargs = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs)
    eos_texts = [t for t in (tokenizer.decode([e]) for e in eos_ids) if t]
    ids: list[int] = []
    for k, choice in enumerate(spliced):
        before, _, text = text.partition(PLACEHOLDER.format(k))
        if k > 0 and spliced[k - 1].ids and spliced[k - 1].ids[-1] in eos_ids:
            before = _drop_eos(before, eos_texts)
        ids += _tokens(tokenizer, before) + list(choice.ids)
    if spliced and spliced[-1].ids and spliced[-1].ids[-1] in eos_ids:
        text = _drop_eos(text, eos_texts)  # the model sampled its end-of-turn marker: keep that one
    return ids + _tokens(tokenizer, text)


def _drop_eos(text: str, eos_texts: list[str]) -> str:
    for eos in eos_texts:
        if text.startswith(eos):
            return text[len(eos) :]
    return text


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []
