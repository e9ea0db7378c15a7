"""Typed containers passed between pipeline stages.

``Sample`` is one scored response as a rollout worker returns it. ``TrainBatch`` is the padded
tensor form the trainer consumes: prompts left-padded to P, responses right-padded to R, so
``input_ids = [prompt | response]`` has shape [B, P + R] and every per-token quantity of the
response (log-probs, advantages, ...) has shape [B, R].
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

NO_VERSION = -1  # the token_versions entry of a tool turn's token: no policy sampled it


@dataclass
class AgentStats:
    """How a sample's agent loop went (``offstep.rollout.agents.agent_loop``)."""

    turns: int = 1  # model turns
    tool_calls: int = 0  # calls that ran a tool
    tool_errors: int = 0  # calls that answered with an error text (malformed ones included)
    attempts: int = 0  # call attempts, well-formed or not
    well_formed: int = 0  # attempts that parsed into a call of a known tool
    tool_time_s: float = 0.0
    max_turns_hit: bool = False  # the loop ended at max_turns with a call it did not run
    prefix_breaks: int = 0  # an OpenAI agent's calls that continued no earlier call token for token (openai_record)


@dataclass
class Sample:
    """One response, scored, tagged with the policy version that generated it.

    A multi-turn sample's response holds the model's turns and the tool turns between them;
    ``loss_mask`` marks the model's tokens (1) and the tools' (0), and the tools' rollout
    log-probs are 0 placeholders. ``loss_mask=None``: every response token is the model's.
    """

    uid: int  # group id: every sample of one prompt shares it
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    score: float
    version: int
    data_source: str = ""
    text: str = ""
    reward_extra: dict = field(default_factory=dict)
    ref_logprobs: Optional[list[float]] = None  # set when the rollout worker holds the reference
    # ReMax: score and length of the greedy response to the same prompt, same weights
    baseline_score: Optional[float] = None
    baseline_length: Optional[int] = None
    loss_mask: Optional[list[int]] = None  # [len(response_ids)]: 1 the model's token, 0 a tool turn's
    agent: Optional[AgentStats] = None  # set by a tool loop
    # the weight version that sampled each response token (pipeline.mode=fully_async, where a load can land
    # inside a sample: a partial rollout), NO_VERSION on a tool turn's (masked); None: every token is of ``version``
    token_versions: Optional[list[int]] = None
    # fully_async: the most versions its K/V cache lagged the weights that decoded it (rollout.max_kv_age)
    kv_age: int = 0
    # distill.teacher: the teacher's log-prob of each response token, and with loss_mode=forward_kl_topk
    # its k most likely ids at each position and their log-probs ([len(response_ids)][k])
    teacher_logprobs: Optional[list[float]] = None
    teacher_topk_ids: Optional[list[list[int]]] = None
    teacher_topk_logprobs: Optional[list[list[float]]] = None

    def __post_init__(self):
        if isinstance(self.agent, dict):  # from a checkpoint's JSON
            self.agent = AgentStats(**self.agent)


@dataclass(frozen=True)
class Span:
    """When a stage ran on a worker (``time.time()``, the worker's clock), and, for the rollout
    side, the policy version it ran with."""

    start: float
    end: float
    version: Optional[int] = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class GenTiming:
    """A rollout worker's report on one generation call: generation with scoring, and the
    reference log-probs when the worker holds the reference (``pipeline.ref_on_rollout``)."""

    gen: Span
    ref: Optional[Span] = None
    tools: tuple[Span, ...] = ()  # when tools ran (merged over samples), for the timeline
    sandbox: tuple = ()  # offstep.sandbox.Execution of each sandboxed run (code rewards, the python tool)
    reward: tuple[Span, ...] = ()  # the reward model's batches (reward.model), for the timeline
    teacher: tuple[Span, ...] = ()  # the distillation teacher's batches (distill.teacher), for the timeline
    cut: int = 0  # samples the over-sampling cut (rollout.over_sample_rate): not among the call's samples


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, P+R] long
    attention_mask: torch.Tensor  # [B, P+R] long
    position_ids: torch.Tensor  # [B, P+R] long
    response_mask: torch.Tensor  # [B, R] float: 1 on the model's response tokens (0 on padding and tool turns)
    rollout_logprobs: torch.Tensor  # [B, R] float
    scores: torch.Tensor  # [B] float
    group_ids: torch.Tensor  # [B] long
    versions: torch.Tensor  # [B] long
    prompt_len: int  # P
    old_logprobs: Optional[torch.Tensor] = None  # [B, R] trainer's log-probs before the update
    ref_logprobs: Optional[torch.Tensor] = None  # [B, R]
    values: Optional[torch.Tensor] = None  # [B, R]
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R]
    staleness: Optional[torch.Tensor] = None  # [B] long: trainer version - sample version
    baseline_scores: Optional[torch.Tensor] = None  # [B] float: ReMax's greedy-response scores
    baseline_lengths: Optional[torch.Tensor] = None  # [B] float: their lengths (overlong penalty)
    teacher_logprobs: Optional[torch.Tensor] = None  # [B, R]: distill.teacher's log-probs of the response tokens
    teacher_topk_ids: Optional[torch.Tensor] = None  # [B, R, k] long: its top-k ids (forward_kl_topk)
    teacher_topk_logprobs: Optional[torch.Tensor] = None  # [B, R, k]: their log-probs (-inf: no id)
    # A vision-language model's images, by uid (group_ids): offstep.models.vision.ImageInputs. A dict,
    # so it rides along select/chunks/to unchanged; the forward picks its rows' entries.
    images: Optional[dict] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]

    def select(self, idx: torch.Tensor | slice) -> "TrainBatch":
        """Rows ``idx`` of every tensor field."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name)[idx]
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def chunks(self, size: int) -> list["TrainBatch"]:
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def to(self, device: torch.device | str) -> "TrainBatch":
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def __reduce__(self):
        """Pickle CPU tensors as numpy arrays. Ray sends those out-of-band (pickle protocol 5)
        instead of through torch's storage pickling: ``ray.put`` of a 32-sample batch takes about
        a third of the time and ``ray.get`` a sixth, on the controller's critical path each step
        (benchmarks/controller_overhead.py)."""
        state = {
            k: _NumpyTensor(v.numpy())
            if isinstance(v, torch.Tensor)
            and v.device.type == "cpu"
            and v.dtype in _NUMPY_DTYPES
            and not v.requires_grad
            else v
            for k, v in vars(self).items()
        }
        return _rebuild_train_batch, (state,)


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool)


class _NumpyTensor:
    """A CPU tensor in transit as its numpy array (see ``TrainBatch.__reduce__``)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


def _rebuild_train_batch(state: dict) -> TrainBatch:
    batch = object.__new__(TrainBatch)
    # Arrays Ray deserialises are read-only views of the object store: copy into own memory.
    batch.__dict__.update(
        {k: torch.from_numpy(v.array.copy()) if isinstance(v, _NumpyTensor) else v for k, v in state.items()}
    )
    return batch


def collate(samples: list[Sample], pad_id: int) -> TrainBatch:
    """Pad samples into a ``TrainBatch`` (prompts left-padded, responses right-padded)."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    P = max(len(s.prompt_ids) for s in samples)
    R = max(1, max(len(s.response_ids) for s in samples))
    B = len(samples)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    rollout_logprobs = torch.zeros((B, R), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, P - p : P] = torch.tensor(s.prompt_ids, dtype=torch.long)
        attention_mask[i, P - p : P + r] = 1
        if r:
            input_ids[i, P : P + r] = torch.tensor(s.response_ids, dtype=torch.long)
            response_mask[i, :r] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
            rollout_logprobs[i, :r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    ref_logprobs = _per_token(samples, "ref_logprobs", B, R)
    teacher = _per_token(samples, "teacher_logprobs", B, R)
    topk_ids = topk_logprobs = None
    if all(s.teacher_topk_ids is not None for s in samples):
        k = max((len(row) for s in samples for row in s.teacher_topk_ids), default=1)
        topk_ids = torch.zeros((B, R, k), dtype=torch.long)
        topk_logprobs = torch.full((B, R, k), -math.inf, dtype=torch.float32)
        for i, s in enumerate(samples):
            for t, (ids, lps) in enumerate(zip(s.teacher_topk_ids, s.teacher_topk_logprobs)):
                topk_ids[i, t, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                topk_logprobs[i, t, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    baseline_scores = baseline_lengths = None
    if all(s.baseline_score is not None for s in samples):
        baseline_scores = torch.tensor([s.baseline_score for s in samples], dtype=torch.float32)
        baseline_lengths = torch.tensor([float(s.baseline_length or 0) for s in samples], dtype=torch.float32)
    # Positions count real tokens only, so a left-padded prompt sees the same positions as unpadded.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        scores=torch.tensor([s.score for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.uid for s in samples], dtype=torch.long),
        versions=torch.tensor([s.version for s in samples], dtype=torch.long),
        prompt_len=P,
        ref_logprobs=ref_logprobs,
        baseline_scores=baseline_scores,
        baseline_lengths=baseline_lengths,
        teacher_logprobs=teacher,
        teacher_topk_ids=topk_ids,
        teacher_topk_logprobs=topk_logprobs,
    )


def _per_token(samples: list[Sample], name: str, B: int, R: int) -> Optional[torch.Tensor]:
    """A per-token list field of every sample as a [B, R] tensor (zero past each response), or None
    unless every sample has it."""
    if not all(getattr(s, name) is not None for s in samples):
        return None
    out = torch.zeros((B, R), dtype=torch.float32)
    for i, s in enumerate(samples):
        if s.response_ids:
            out[i, : len(s.response_ids)] = torch.tensor(getattr(s, name), dtype=torch.float32)
    return out


# ------------------------------------------------------------------ micro-batching by token budget
#
# With ragged response lengths, fixed-count micro-batches of a padded batch spend most of their
# compute on padding: every row is as long as the longest prompt plus the longest response of the
# whole batch. Instead (as verl's ``use_dynamic_bsz`` does with a per-GPU token budget) samples are
# sorted by length and grouped so that each micro-batch's padded cost (rows x width) fits a token
# budget, and each micro-batch is cut down to the columns its own rows use. Both are exact: the
# loss normaliser is global per mini-batch, padding columns are masked out of attention, and
# ``position_ids`` come from the attention mask, so removing leading pad columns moves no token.

SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids")  # [B, P+R]; other 2-D fields are [B, R]


def sample_lengths(batch: TrainBatch) -> tuple[list[int], list[int]]:
    """Real (non-pad) prompt and response token counts of every row (tool turns included)."""
    prompt = batch.attention_mask[:, : batch.prompt_len].sum(-1)
    response = batch.attention_mask[:, batch.prompt_len :].sum(-1)
    return [int(x) for x in prompt], [int(x) for x in response]


def plan_micro_batches(
    prompt_lens: list[int], response_lens: list[int], token_budget: int, min_count: int = 1
) -> list[list[int]]:
    """Group row indices into micro-batches whose padded cost fits ``token_budget``.

    The cost of a micro-batch is ``rows x (longest prompt + longest response)`` among its rows:
    the width it has once its unused pad columns are trimmed (``trim_padding``). Rows are sorted
    by total length, longest first, and filled greedily: a row joins the current micro-batch if
    the cost stays within the budget, otherwise it opens the next one. A row longer than the
    budget on its own gets a micro-batch of its own. Then, while there are fewer than
    ``min_count`` micro-batches, the one with most rows is halved (every data-parallel rank must
    run the same number of forward/backward passes, since FSDP's collectives pair them up).

    Returns lists of row indices, each in ascending order; together they cover every row once.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(response_lens)} response lengths")
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1")
    n = len(prompt_lens)
    if min_count > n:
        raise ValueError(f"cannot split {n} rows into {min_count} micro-batches")
    order = sorted(range(n), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    groups: list[list[int]] = []
    max_p = max_r = 0
    for i in order:
        p, r = max(max_p, prompt_lens[i]), max(max_r, response_lens[i])
        if groups and (len(groups[-1]) + 1) * (p + r) <= token_budget:
            groups[-1].append(i)
            max_p, max_r = p, r
        else:
            groups.append([i])
            max_p, max_r = prompt_lens[i], response_lens[i]
    while len(groups) < min_count:
        j = max(range(len(groups)), key=lambda g: len(groups[g]))
        g = groups[j]
        groups[j : j + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return [sorted(g) for g in groups]


def trim_padding(mb: TrainBatch) -> TrainBatch:
    """``mb`` without the columns none of its rows uses.

    Drops leading prompt columns that are padding in every row and trailing response columns past
    the longest response (at least one response column is kept). Positions are sliced, not
    recomputed, so every real token keeps its position; per-token [B, R] fields keep the first
    R' columns, so outputs computed on the result are ``scatter_rows``-ed back to width R.
    """
    P, R = mb.prompt_len, mb.response_mask.shape[1]
    keep_p = int(mb.attention_mask[:, :P].sum(-1).max())
    keep_r = max(1, int(mb.attention_mask[:, P:].sum(-1).max()))
    if keep_p == P and keep_r == R:
        return mb
    out = {}
    for f in dataclasses.fields(mb):
        t = getattr(mb, f.name)
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            continue  # [B, P+R], [B, R] and [B, R, k] fields are cut
        out[f.name] = t[:, P - keep_p : P + keep_r] if f.name in SEQUENCE_FIELDS else t[:, :keep_r]
    return dataclasses.replace(mb, prompt_len=keep_p, **out)


def prompt_groups(batch: TrainBatch) -> list[list[int]]:
    """Row indices grouped by identical prompt tokens, in order of first appearance."""
    P = batch.prompt_len
    groups: dict[tuple, list[int]] = {}
    for b, p in enumerate(batch.attention_mask[:, :P].sum(-1).tolist()):
        groups.setdefault(tuple(batch.input_ids[b, P - int(p) : P].tolist()), []).append(b)
    return list(groups.values())


# A packed sequence (a prompt, then its responses end to end) is at most this many times as long as
# its group's longest sample: attention over it costs about its length squared, and its mask is
# dense, so a group of many long responses is packed in several sequences, not one.
PACKED_LENGTH_FACTOR = 2


def prompt_units(
    groups: list[list[int]],
    prompt_lens: list[int],
    response_lens: list[int],
    token_budget: int | None = None,
    min_count: int = 1,
) -> list[list[int]]:
    """Rows sharing a prompt, cut into units that each run as one packed sequence (the prompt once,
    then every response: ``offstep.models.prompt_sharing``), at most ``token_budget`` tokens (None:
    no budget) and ``PACKED_LENGTH_FACTOR`` times the group's longest sample. A group too long is
    cut greedily, in row order; a row too long alone is a unit of its own. Then, while there are
    fewer than ``min_count`` units, the one with most rows is halved."""
    units: list[list[int]] = []
    for rows in groups:
        p = prompt_lens[rows[0]]
        limit = PACKED_LENGTH_FACTOR * (p + max(response_lens[b] for b in rows))
        if token_budget is not None:
            limit = min(limit, token_budget)
        unit: list[int] = []
        for b in rows:
            if unit and p + sum(response_lens[i] for i in unit) + response_lens[b] > limit:
                units.append(unit)
                unit = []
            unit.append(b)
        units.append(unit)
    while len(units) < min_count:
        j = max(range(len(units)), key=lambda u: len(units[u]))
        if len(units[j]) < 2:
            raise ValueError(f"cannot split {sum(map(len, units))} rows into {min_count} micro-batches")
        u = units[j]
        units[j : j + 1] = [u[: len(u) // 2], u[len(u) // 2 :]]
    return units


def micro_batches(
    batch: TrainBatch,
    micro_batch_size: int,
    token_budget: int = 0,
    min_count: int = 1,
    share_prompts: bool = False,
) -> list[tuple[torch.Tensor, TrainBatch]]:
    """(row indices, micro-batch) pairs covering ``batch``.

    ``token_budget == 0``: contiguous chunks of ``micro_batch_size`` rows, untouched (the padded
    layout). Otherwise: ``plan_micro_batches`` groups, each passed through ``trim_padding``. With
    ``share_prompts`` the budget plans ``prompt_units`` instead of rows, a unit costing its prompt
    once and its responses end to end, so that rows of one prompt share a micro-batch.
    """
    if token_budget <= 0:
        return [
            (torch.arange(i, min(i + micro_batch_size, len(batch))), batch.select(slice(i, i + micro_batch_size)))
            for i in range(0, len(batch), micro_batch_size)
        ]
    prompt_lens, response_lens = sample_lengths(batch)
    if share_prompts:
        units = prompt_units(prompt_groups(batch), prompt_lens, response_lens, token_budget, min_count)
        plan = plan_micro_batches(
            [prompt_lens[u[0]] for u in units],
            [sum(response_lens[b] for b in u) for u in units],
            token_budget,
            min_count,
        )
        plan = [sorted(b for j in group for b in units[j]) for group in plan]
    else:
        plan = plan_micro_batches(prompt_lens, response_lens, token_budget, min_count)
    out = []
    for rows in plan:
        idx = torch.tensor(rows, dtype=torch.long)
        out.append((idx, trim_padding(batch.select(idx.to(batch.input_ids.device)))))
    return out


def scatter_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], n_rows: int, width: int) -> torch.Tensor:
    """Undo a micro-batch split of per-token outputs: ``parts`` holds (row indices, [b, r <= width])
    pairs; the result is [n_rows, width] in the original row order, zero past each part's width."""
    first = parts[0][1]
    out = torch.zeros((n_rows, width), dtype=first.dtype, device=first.device)
    for idx, t in parts:
        out[idx.to(out.device), : t.shape[1]] = t
    return out
