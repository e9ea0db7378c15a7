"""The serving loop of the vLLM engine (``offstep.rollout.engines.vllm_engine.VLLMEngine.serve``): this
thread steps vLLM's ``LLMEngine`` itself, one decode step per ``step()``, so that what another
thread posts to a ``StepControl`` (``offstep.rollout.engines.control``: weight loads, suspensions, work)
is carried out between two decode steps, and each step's tokens are tagged with the version of the
weights that sampled them. It uses vLLM's public request API only (``add_request``, ``step``,
``abort_request``, ``reset_prefix_cache``); how each ``rollout.partial`` maps onto vLLM:
docs/engines.md, "Partial rollouts on vLLM"."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from offstep.rollout.engines.control import SUSPENDED, StepControl
from offstep.rollout.types import Completion, SamplingParams, TurnFeed

_CALLS = itertools.count()  # request ids unique within the process


@dataclass
class _Live:
    """A request of a serving loop, as far as it got: its tokens, their log-probs and versions."""

    index: int
    group: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def serve(
    engine,
    feed: TurnFeed,
    params: SamplingParams,
    seed: int,
    on_finish: Callable[[int, Completion], None],
    control: StepControl | None,
) -> None:
    """``engine.serve`` (a ``VLLMEngine``): see the module's docstring. Steps that a call nested in
    this one runs (posted work: a validation's ``generate``, a reference pass) hand the outputs of
    this loop's requests back to it through ``engine._route``."""
    call = next(_CALLS)
    live: dict[str, _Live] = {}
    streaming = control is not None
    llm = engine._engine

    def emit(rid: str, reason: str) -> None:
        rec = live.pop(rid)
        on_finish(rec.index, engine._completion(rec.group, rec.tokens, rec.logprobs, reason, rec.versions))

    def record(out) -> None:
        rec = live.get(out.request_id)
        if rec is None:
            return
        step = out.outputs[0]
        ids = list(step.token_ids)
        if step.logprobs is None or len(step.logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {0 if step.logprobs is None else len(step.logprobs)} log-probs for {len(ids)} tokens"
            )
        rec.tokens += ids
        rec.logprobs += [float(lp[t].logprob) for t, lp in zip(ids, step.logprobs)]
        rec.versions += [engine.version] * len(ids)
        if out.finished:
            if step.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended a sample with finish_reason={step.finish_reason!r}")
            emit(out.request_id, step.finish_reason)

    outer = engine._route
    engine._route = outer or record
    open_feed = True
    try:
        while True:
            admit = _between_steps(engine, control, live, emit) if streaming else True
            # Streaming takes no more than vLLM runs at once, so that no request waits in vLLM's
            # queue across a load with the cache salt of the weights before it.
            room = engine.max_batch_size - len(live) if streaming else 1 << 30
            new = feed.take(room, block=not live) if admit and open_feed and room > 0 else []
            if new is None:
                open_feed, new = False, []
            for req in new:
                rid = f"offstep-{call}-{req.index}"
                llm.add_request(
                    rid,
                    engine._prompt(req.prompt_ids),
                    engine._vllm_params(
                        params if req.stop is None else dataclasses.replace(params, stop=req.stop),
                        engine._seed(seed, req),
                        req.max_new_tokens,
                    ),
                    lora_request=engine._lora_request,
                )
                live[rid] = _Live(req.index, req.group)
            if not live:
                if open_feed:
                    continue
                break
            for out in llm.step():
                (record if out.request_id in live else engine._route)(out)
            if streaming:
                control.decoded()
    finally:
        engine._route = outer
        if live:  # an exception (a scorer, Ctrl-C): leave no request running in the engine
            llm.abort_request(list(live))
        if control is not None:
            control.detach()


def _between_steps(engine, control: StepControl, live: dict[str, _Live], emit: Callable[[str, str], None]) -> bool:
    """What ``control`` posted, carried out between two decode steps. A suspension aborts the
    running requests (emitted ``suspended``, their tokens so far kept). A load: ``keep`` loads
    under the running requests, whose KV blocks stay; ``recompute`` then has vLLM preempt them
    (``reset_prefix_cache(reset_running_requests=True)``): each is prefilled again, prompt and
    tokens so far, under the new weights, its random generator going on where it was; ``off``
    returns False (take no new request) until the running ones finished, then loads."""
    control.run_work()
    act = control.pending()
    if act == "suspend":
        if live:
            engine._engine.abort_request(list(live))
        for rid in list(live):
            emit(rid, SUSPENDED)
        control.run_suspend()
    elif act == "load":
        if control.partial == "off" and live:
            return False
        control.run_load()
        if (
            control.kv_bound == 0
            and live
            and not engine._engine.reset_prefix_cache(  # recompute, or max_kv_age=0
                reset_running_requests=True
            )
        ):
            raise RuntimeError("vLLM could not preempt its running requests to recompute them under the new weights")
    return True
