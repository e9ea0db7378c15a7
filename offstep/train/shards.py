"""How a batch is split over a role's data-parallel ranks, when it divides and when it does not.

A batch whose rows and mini-batch both divide over the ranks is split as always: each rank a
contiguous share, its mini-batches chunks of it. Otherwise (verl's 512 x 16 samples on 12 ranks)
each mini-batch, contiguous rows of the batch as on one rank, is split into shares whose sizes
differ by at most one, and every share is padded to the largest with filler rows: copies of a row
with an empty response mask. FSDP's collectives need the same number of passes on every rank; a
filler has no valid token, so it adds nothing to any loss term nor to the normalisers
(``RoleWorker._denominator`` counts tokens or sequences with a valid token), and the gradient is
that of the unpadded mini-batch, the same as on one rank.
"""

from __future__ import annotations

import torch

from offstep.batch import TrainBatch

FILLER = -1  # a plan's entry for a filler row


def divides(rows: int, world: int, mini: int) -> bool:
    return rows % world == 0 and mini % world == 0


def shard_plan(rows: int, world: int, mini: int) -> list[list[int]]:
    """Per rank, the batch rows it holds in order (``FILLER`` for a filler); every rank holds as
    many, and its mini-batches are consecutive chunks of :func:`local_mini` of them."""
    if divides(rows, world, mini):
        per = rows // world
        return [list(range(r * per, (r + 1) * per)) for r in range(world)]
    plan: list[list[int]] = [[] for _ in range(world)]
    for start in range(0, rows, mini):
        size = min(mini, rows - start)
        width = -(-size // world)
        base, extra = divmod(size, world)
        at = start
        for r in range(world):
            take = base + (1 if r < extra else 0)
            plan[r] += list(range(at, at + take)) + [FILLER] * (width - take)
            at += take
    return plan


def local_mini(rows: int, world: int, mini: int) -> int:
    """Rows of a rank's mini-batch (fillers included) under :func:`shard_plan`."""
    return mini // world if divides(rows, world, mini) else -(-mini // world)


def take_rows(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    """``batch``'s rows in ``rows`` order; a ``FILLER`` is a copy of row 0 with no valid token."""
    if rows and rows[0] >= 0 and rows == list(range(rows[0], rows[0] + len(rows))):  # contiguous, no filler
        return batch.select(slice(rows[0], rows[0] + len(rows)))
    idx = torch.tensor([max(i, 0) for i in rows], dtype=torch.long)
    out = batch.select(idx)
    filler = torch.tensor([i == FILLER for i in rows])
    if bool(filler.any()):
        out.response_mask = out.response_mask.clone()
        out.response_mask[filler] = 0
        if out.advantages is not None:
            out.advantages = out.advantages.clone()
            out.advantages[filler] = 0
    return out


def unshard(gathered: torch.Tensor, plan: list[list[int]], rows: int) -> torch.Tensor:
    """Every rank's per-row outputs, concatenated in rank order, back in the batch's row order
    (fillers dropped)."""
    flat = [i for share in plan for i in share]
    keep = torch.tensor([i != FILLER for i in flat])
    order = torch.tensor([i for i in flat if i != FILLER], dtype=torch.long)
    out = torch.empty((rows, *gathered.shape[1:]), dtype=gathered.dtype)
    out[order] = gathered[keep]
    return out
