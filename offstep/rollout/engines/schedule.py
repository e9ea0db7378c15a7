"""The two schedulers of the built-in engine (``offstep.rollout.engines.torch_engine.TorchEngine``): continuous
batching over the slots of a KV cache (``continuous``, the slot runner), and static sub-batches for
the fallback on the model's own forward (``static``). Each takes the engine whose runner, sampling
state and token bookkeeping (``_append``) it drives; ``TorchEngine.serve`` picks one."""

from __future__ import annotations

import torch
from torch import Tensor

from offstep.models.vision import ban_vision_tokens
from offstep.rollout.engines.control import SUSPENDED, StepControl
from offstep.rollout.engines.plain_generation import PromptFeed
from offstep.rollout.engines.sampling import sample_tokens, sample_uniforms
from offstep.rollout.types import SamplingParams, TurnFeed, TurnRequest


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, leaving each prompt at least one token of its own."""
    first = prompts[0]
    limit = min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


class Row:
    """Decoding state of one sample (or one turn of an agent loop): at most ``limit`` tokens."""

    __slots__ = (
        "images",
        "index",
        "kv_age",
        "kv_version",
        "limit",
        "logprobs",
        "prompt",
        "prompt_index",
        "stop",
        "tokens",
        "versions",
    )

    def __init__(
        self,
        index: int,
        prompt_index: int,
        limit: int,
        prompt: list[int] = (),
        stop: tuple[str, ...] | None = None,
        images=None,
    ):
        self.index = index
        self.prompt_index = prompt_index
        self.limit = limit
        self.prompt = prompt  # its tokens before the first it samples (a recompute prefills them again)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # the weight version that sampled each token
        self.stop = stop  # its own stop strings; None: the call's
        self.images = images  # its prompt's images (offstep.models.vision.ImageInputs), or None
        self.kv_version = -1  # the version its oldest K/V entries were computed with (set when prefilled)
        self.kv_age = 0  # the most versions its K/V lagged the weights it decoded with


def stale_rows(rows: list[Row], version: int, control: StepControl) -> list[int]:
    """After a load of ``version``: the rows whose K/V would lag it by more than the bound
    (``rollout.max_kv_age``; ``recompute``: 0), to prefill again. The others keep their K/V and
    record how far it lags."""
    bound = control.kv_bound
    stale = []
    for j, r in enumerate(rows):
        age = version - r.kv_version
        if age > bound:
            stale.append(j)
            r.kv_version = version
        else:
            r.kv_age = max(r.kv_age, age)
    return stale


def _row(req: TurnRequest) -> Row:
    return Row(req.index, req.group, req.max_new_tokens, req.prompt_ids, req.stop, req.images)


def _uniforms(requests: list[TurnRequest], params: SamplingParams, seed: int, device) -> Tensor:
    """The uniforms of each request's own random stream, from its seed and offset."""
    return sample_uniforms(
        [r.stream for r in requests],
        params,
        seed,
        device,
        seeds=[r.seed for r in requests],
        offsets=[r.offset for r in requests],
    )


# ---------------------------------------------------------------- continuous batching


def continuous(engine, feed: TurnFeed, params: SamplingParams, seed: int, emit, control: StepControl | None) -> None:
    """Decode with slots freed by finished samples refilled from the feed at the next step.

    State of the ``B`` running samples lives in slots ``0..B-1`` (rows of the tensors below and
    of the KV cache): ``tok`` the next input token, ``pos`` its position (= cached length),
    ``step`` how many tokens the sample has, ``uni`` the uniforms of its random stream.
    """
    runner, dev = engine._runner, engine.device
    prompts = feed.prompts
    slots = min(engine.max_batch_size, feed.concurrency)
    plen = max(len(p) for p in prompts)
    shared = shared_prefix(prompts) if getattr(feed, "share_prefix", True) else 0
    if shared < engine.min_shared_prefix or (len(prompts) == 1 and params.n <= slots and isinstance(feed, PromptFeed)):
        shared = 0  # nothing to reuse: every prompt is prefilled once anyway
    # One slot more holds the shared prefix; admitted prompts copy it and prefill the rest.
    cache = runner.new_cache(slots + (shared > 0), plen + min(params.max_new_tokens, 256), plen + params.max_new_tokens)
    none = torch.zeros(0, dtype=torch.long, device=dev)
    prefix_version = None  # the version the shared prefix's K/V was computed with: reused only by that version
    prefix_src = torch.full((slots,), slots, dtype=torch.long, device=dev)
    tok, pos, step = (torch.zeros(slots, dtype=torch.long, device=dev) for _ in range(3))
    uni = torch.zeros((slots, max(1, params.max_new_tokens)), dtype=torch.float64, device=dev)
    window = 4 * max((len(s) for s in params.stop), default=0) + 4
    rows: list[Row] = []
    open_feed = True
    while True:
        admit = True
        if control is not None:
            control.run_work()
        if control is not None and (act := control.pending()) is not None:
            if act == "suspend":  # every running sample ends here, its tokens so far kept
                for row in rows:
                    emit(row, SUSPENDED)
                rows = []
                control.run_suspend()
            elif control.partial == "off" and rows:
                admit = False  # the running samples finish under the old weights first
            else:
                control.run_load()
                if stale := stale_rows(rows, engine.version, control):
                    # Those samples' K/V again under the new weights: the prompt and the tokens but
                    # the last, which is the next step's input as before.
                    runner.step(
                        cache, none, none, [rows[j].prompt + rows[j].tokens[:-1] for j in stale], [[j] for j in stale]
                    )
        b = len(rows)
        # ---- admit waiting requests into the free slots; each new prompt is prefilled once
        new = feed.take(slots - b, block=b == 0) if admit and open_feed and b < slots else []
        if new is None:
            open_feed, new = False, []
        if not new and not rows:
            if open_feed:
                continue
            break
        new_prompts: list[list[int]] = []
        new_slots: list[list[int]] = []
        logit_row = list(range(b))  # row of the step's logits that each slot samples from
        last_group = None
        for req in new:  # a plain call's are prompt-major: the samples of a prompt are admitted together
            if req.group != last_group:
                new_prompts.append(req.prompt_ids[shared:])
                new_slots.append([])
                last_group = req.group
            new_slots[-1].append(len(rows))
            logit_row.append(b + len(new_prompts) - 1)
            rows.append(_row(req))
            rows[-1].kv_version = engine.version
        bt = len(rows)
        if shared and bt > b and prefix_version != engine.version:  # keyed by weight version: never a stale prefix
            runner.step(cache, none, none, [prompts[0][:shared]], [[slots]])
            prefix_version = engine.version
        if shared and bt > b:
            cache.move(prefix_src[: bt - b], torch.arange(b, bt, device=dev), shared)
        logits = runner.step(cache, tok[:b], pos[:b], new_prompts, new_slots, start=shared)
        if len(logit_row) != logits.shape[0]:
            logits = logits[torch.tensor(logit_row, device=dev)]
        pos[:b] += 1
        if bt > b:
            pos[b:bt] = torch.tensor([len(req.prompt_ids) for req in new], device=dev)
            uni[b:bt] = _uniforms(new, params, seed, dev)
            step[b:bt] = 0
        # ---- sample every running slot at once, each from its own stream
        tokens, logps = sample_tokens(logits, params, uni[torch.arange(bt, device=dev), step[:bt]])
        if control is not None:
            control.decoded()
        tok[:bt] = tokens
        step[:bt] += 1
        done = []
        for j, (t, lp) in enumerate(zip(tokens.tolist(), logps.tolist())):
            reason = engine._append(rows[j], t, lp, params, window)
            if reason is not None:
                emit(rows[j], reason)
                done.append(j)
        if done:
            rows = _compact(rows, done, cache, (tok, pos, step, uni))


def _compact(rows: list[Row], done: list[int], cache, state: tuple[Tensor, ...]) -> list[Row]:
    """Drop finished slots, moving the last running slots into the holes (the batch stays dense)."""
    order = list(range(len(rows)))  # order[j]: the old slot that new slot j takes
    for j in sorted(done, reverse=True):
        order[j] = order[-1]
        order.pop()
    # Moved slots come from the tail (>= the new size) into holes (< the new size): disjoint.
    moves = [(src, dst) for dst, src in enumerate(order) if src != dst]
    if moves:
        dev = state[0].device
        src = torch.tensor([m[0] for m in moves], device=dev)
        dst = torch.tensor([m[1] for m in moves], device=dev)
        cache.move(src, dst, int(state[1][src].max()))  # state[1]: cached length per slot
        for t in state:
            t[dst] = t[src]
    return [rows[o] for o in order]


# ---------------------------------------------------------------- fallback: static sub-batches


def static(engine, feed: TurnFeed, params: SamplingParams, seed: int, emit, control: StepControl | None) -> None:
    """Static sub-batches of what the feed has (all of a plain call's samples at once; an agent
    loop's requests in waves: each wave is what has arrived when the previous one ends). Between
    two sub-batches nothing runs, so a posted weight load lands there whatever ``partial`` says."""
    while (requests := feed.take(1 << 30, block=True)) is not None:
        # Group similar prompt lengths into the same sub-batch (less padding); stable, so each
        # prompt's samples stay together.
        order = sorted(requests, key=lambda req: len(req.prompt_ids))
        for start in range(0, len(order), engine.max_batch_size):
            chunk = order[start : start + engine.max_batch_size]
            rows = [_row(req) for req in chunk]
            if control is not None:
                control.run_work()
                if control.pending() == "suspend":  # not started: emitted with no tokens
                    for row in rows:
                        emit(row, SUSPENDED)
                    continue
                control.run_load()
            for row in rows:
                row.kv_version = engine.version
            uniforms = _uniforms(chunk, params, seed, engine.device)
            _chunk(engine, {req.group: req.prompt_ids for req in chunk}, rows, params, uniforms, emit, control)
        if control is not None:
            control.run_work()
            control.run_suspend()
            control.run_load()


def _chunk(
    engine,
    prompts: dict[int, list[int]],
    rows: list[Row],
    params: SamplingParams,
    uniforms: Tensor,
    emit,
    control: StepControl | None = None,
) -> None:
    # ---- prefill the unique prompts of this chunk once; one cache row per sample
    unique: dict[int, int] = {}
    for row in rows:
        unique.setdefault(row.prompt_index, len(unique))
    runner = engine._fallback
    images = {row.prompt_index: row.images for row in rows}
    logits, batch = runner.prefill(
        [prompts[pi] for pi in unique], [unique[row.prompt_index] for row in rows], [images[pi] for pi in unique]
    )

    window = 4 * max((len(s) for s in params.stop), default=0) + 4
    active = list(range(len(rows)))  # chunk-local row numbers still decoding, in batch order
    for step in range(params.max_new_tokens):
        ban_vision_tokens(logits, engine.banned_ids)
        tokens, logps = sample_tokens(logits, params, uniforms[active, step])
        if control is not None:
            control.decoded()
        keep: list[int] = []
        for b, (t, lp) in enumerate(zip(tokens.tolist(), logps.tolist())):
            reason = engine._append(rows[active[b]], t, lp, params, window)
            if reason is None:
                keep.append(b)
            else:
                emit(rows[active[b]], reason)
        if not keep:
            return
        if len(keep) != len(active):
            sel = torch.tensor(keep, dtype=torch.long, device=engine.device)
            batch.select(sel)
            tokens = tokens[sel]
            active = [active[b] for b in keep]
        if control is not None:
            control.run_work()
        if control is not None and (act := control.pending()) is not None:
            if act == "suspend":  # the running rows end here, their tokens so far kept
                for i in active:
                    emit(rows[i], SUSPENDED)
                return
            if control.partial != "off":  # off: the load waits for the end of this sub-batch
                control.run_load()
                # The rows of a sub-batch were prefilled together: all or none are past the bound.
                if stale_rows(
                    [rows[i] for i in active], engine.version, control
                ):  # their K/V again, under the new weights
                    _, batch = runner.prefill(
                        [rows[i].prompt + rows[i].tokens[:-1] for i in active],
                        list(range(len(active))),
                        [rows[i].images for i in active],
                    )
        logits = runner.decode(batch, tokens)
