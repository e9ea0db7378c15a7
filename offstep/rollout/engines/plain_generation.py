"""Plain generation through an engine's ``serve``: ``n`` samples of each prompt, prompt-major
(``generate`` of both engines), and verl's over-sampling (``rollout.over_sample_rate``).

Over-sampling cuts the long tail of a call: once ``int(total * (1 - over_sample_rate))`` of its
``total`` samples have finished (at least one), no sample is started any more and the ones in
flight are ended at the next step boundary, as verl's rollout aborts its remaining requests. A
sample ended so has the finish reason ``suspended`` (its tokens so far), one never started
``cut`` (no tokens); neither is scored nor trained on. Which samples are cut is decided by the
engine's decode steps, not by the clock, so a run is as reproducible with it as without.
"""

from __future__ import annotations

from collections.abc import Callable

from offstep.rollout.engines.control import SUSPENDED, StepControl
from offstep.rollout.types import Completion, SamplingParams, TurnRequest

CUT = "cut"  # the finish reason of a sample the over-sampling never started
CUT_REASONS = (CUT, SUSPENDED)  # a plain generation's samples that did not finish


class PromptFeed:
    """The feed of plain generation: ``n`` samples of each prompt, prompt-major, all at once
    (until ``close``: no sample is started after it)."""

    def __init__(self, prompts: list[list[int]], n: int, max_new_tokens: int, images: list | None = None):
        self.prompts, self.n, self.max_new_tokens = prompts, n, max_new_tokens
        self.images = images or [None] * len(prompts)  # per prompt: its ImageInputs or None
        self.next, self.total = 0, len(prompts) * n
        self.concurrency = self.total

    def take(self, limit: int, block: bool) -> list[TurnRequest] | None:
        if self.next >= self.total:
            return None
        out = []
        while self.next < self.total and len(out) < limit:
            i = self.next
            p = i // self.n
            out.append(TurnRequest(i, self.prompts[p], i, self.max_new_tokens, p, images=self.images[p]))
            self.next += 1
        return out

    def close(self) -> None:
        self.next = self.total


def finish_target(total: int, over_sample_rate: float) -> int:
    """How many of ``total`` samples finish before the rest are cut: verl's
    ``int(total * (1 - over_sample_rate))``, at least one; ``total`` without over-sampling."""
    if over_sample_rate <= 0:
        return total
    return max(1, int(total * (1.0 - over_sample_rate)))


def serve_prompts(
    serve,
    prompts: list[list[int]],
    params: SamplingParams,
    seed: int,
    on_finish: Callable | None = None,
    images: list | None = None,
) -> list[Completion]:
    """``params.n`` completions per prompt, prompt-major, through ``serve``; ``on_finish(completion)``
    is called as each finishes (a cut one excepted). With ``params.over_sample_rate`` the samples
    past the finish target come back with finish reason ``suspended`` or ``cut`` (see the module's doc)."""
    total = len(prompts) * params.n
    results: list[Completion | None] = [None] * total
    if not results:
        return []
    feed = PromptFeed(prompts, params.n, params.max_new_tokens, images)
    target = finish_target(total, params.over_sample_rate)
    control = None
    if target < total:  # in flight when the target is met: ended at the next step boundary
        control = StepControl("keep")
        control.attach(lambda: None)  # this thread serves: nothing to wake
    finished = 0

    def store(index: int, c: Completion) -> None:
        nonlocal finished
        results[index] = c
        if c.finish_reason == SUSPENDED:
            return
        finished += 1
        if on_finish is not None:
            on_finish(c)
        if control is not None and finished == target:
            feed.close()
            control.post_suspend()  # carried out by this thread at its next step boundary

    serve(feed, params, seed, store, control)
    for i, c in enumerate(results):
        if c is None:  # never started
            results[i] = Completion(i // params.n, [], [], CUT, text="")
    return results  # type: ignore[return-value]
