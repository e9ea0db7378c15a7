"""What one training batch is made of when DAPO's dynamic sampling is on (Yu et al. 2025,
arXiv:2503.14476, section 3.2): groups whose rewards are all equal are dropped and more prompts are
generated until ``data.train_batch_size`` groups remain, at most
``algorithm.dynamic_sampling_max_attempts`` generations per batch.

The extra prompts of attempt ``a`` of batch ``b`` are a pure function of (seed, b, a), not draws
from the shared prompt stream: batches generate concurrently when ``max_staleness >= 1``, so
draws from one stream would depend on timing; this way a run, and a resumed run, is reproducible.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from offstep.algos.dapo import dynamic_sampling_keep
from offstep.batch import Sample
from offstep.config.schema import AlgorithmConfig
from offstep.envs.failures import split_failed


def refill_indices(seed: int, batch_idx: int, attempt: int, num_items: int, size: int) -> list[int]:
    """``size`` distinct training-set indices for extra attempt ``attempt`` (>= 1) of a batch."""
    rng = np.random.default_rng([seed, batch_idx, attempt])
    return [int(i) for i in rng.choice(num_items, size=min(size, num_items), replace=False)]


@dataclass
class Generated:
    """A batch as generated: every attempt's per-replica results, the samples to train on, and
    which training-set prompt each group (uid) came from."""

    rounds: list[list] = field(default_factory=list)  # per attempt: [(samples, timing) per replica]
    samples: list[Sample] = field(default_factory=list)
    prompt_of: dict[int, int] = field(default_factory=dict)  # uid -> training-set index
    kept_groups: int = 0  # groups with unequal rewards (dynamic sampling)
    filled_groups: int = 0  # equal-reward groups used to fill a batch the attempts could not fill
    dropped: list[Sample] = field(default_factory=list)  # groups with an environment's failed rollout (env.on_error)


def assemble(samples: list[Sample], groups_needed: int) -> tuple[list[Sample], int, int]:
    """The first ``groups_needed`` groups with unequal rewards, topped up (when there are too
    few) with equal-reward groups, which carry zero group-relative advantage. Returns (samples,
    kept groups, filled groups)."""
    groups: OrderedDict[int, list[Sample]] = OrderedDict()
    for s in samples:
        groups.setdefault(s.uid, []).append(s)
    uids = list(groups)
    scores = torch.tensor([s.score for u in uids for s in groups[u]], dtype=torch.float64)
    gids = torch.tensor([u for u in uids for _ in groups[u]])
    keep = dynamic_sampling_keep(scores, gids).tolist()
    first, pos = {}, 0
    for u in uids:
        first[u] = keep[pos]
        pos += len(groups[u])
    good = [u for u in uids if first[u]][:groups_needed]
    fill = [u for u in uids if not first[u]][: groups_needed - len(good)]
    chosen = set(good) | set(fill)
    return [s for u in uids if u in chosen for s in groups[u]], len(good), len(fill)


def generate_batch(
    submit: Callable[..., asyncio.Future],
    prompts: list,
    params,
    algo: AlgorithmConfig,
    seed: int,
    batch_idx: int,
    idx: list[int],
) -> asyncio.Future:
    """One batch: its prompts ``idx`` once, or with dynamic sampling, more prompts until enough
    groups have unequal rewards. ``submit(prompts, params, seed, key, uid0)`` is the fleet's. The
    first round is submitted before this returns (see ``RolloutFleet.submit``), so a weight load
    queued after it is ordered after this batch's generation; the future gives the ``Generated``."""
    bs = len(idx)
    attempts = algo.dynamic_sampling_max_attempts if algo.dynamic_sampling else 1
    gen = Generated()

    def submit_round(attempt: int) -> asyncio.Future:
        prompt_idx = idx if attempt == 0 else refill_indices(seed, batch_idx, attempt, len(prompts), bs)
        uid0 = (batch_idx * attempts + attempt) * bs
        gen.prompt_of.update({uid0 + j: i for j, i in enumerate(prompt_idx)})
        key = batch_idx + attempt * 1_000_003  # attempt 0 keeps the plain run's sampling seeds
        return submit([prompts[i] for i in prompt_idx], params, seed, key, uid0)

    first = submit_round(0)

    async def collect() -> Generated:
        chosen = []
        for attempt in range(attempts):
            results = await (first if attempt == 0 else submit_round(attempt))
            gen.rounds.append(results)
            kept, dropped = split_failed([s for samples, _ in results for s in samples])
            gen.samples.extend(kept)
            gen.dropped.extend(dropped)
            if gen.dropped and not gen.samples and attempt + 1 == attempts:
                raise RuntimeError(
                    f"every group of batch {batch_idx} had a rollout whose environment failed "
                    "(env.on_error): nothing is left to train. See env/errors, env/timeouts"
                )
            if not algo.dynamic_sampling:
                return gen
            chosen, gen.kept_groups, gen.filled_groups = assemble(gen.samples, bs)
            if gen.kept_groups == bs:
                break
        gen.samples = chosen
        return gen

    return asyncio.ensure_future(collect())
