"""An endless, seeded, resumable stream of prompt-index batches."""

from __future__ import annotations

from typing import Iterator

import numpy as np


class PromptStream:
    """Batches of item indices, epoch after epoch, forever.

    Each epoch visits a permutation of ``range(num_items)`` in consecutive slices of
    ``batch_size``; the last incomplete slice of every epoch is dropped, so an epoch has
    ``num_items // batch_size`` batches. The permutation of epoch ``e`` depends only on
    ``(seed, e)`` (``numpy.random.default_rng([seed, e])``), or is the identity when
    ``shuffle=False``. Restoring :meth:`state_dict` into a fresh stream makes it yield exactly the
    batches the original would have yielded next.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True):
        num_items, batch_size, seed = int(num_items), int(batch_size), int(seed)
        if num_items <= 0:
            raise ValueError(f"PromptStream needs at least one item, got num_items={num_items}.")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}.")
        if batch_size > num_items:
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({num_items} prompts), so no "
                "full batch fits in an epoch. Fix: lower data.train_batch_size or use a larger "
                "dataset."
            )
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}.")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = bool(shuffle)
        self._epoch = 0
        self._position = 0  # offset into the current epoch's permutation of the next batch
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    # ----------------------------------------------------------------------------------------------

    @property
    def batches_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    @property
    def batches_consumed(self) -> int:
        """Number of batches yielded so far (counting from the start of epoch 0)."""
        return self._epoch * self.batches_per_epoch + self._position // self.batch_size

    @property
    def epoch(self) -> int:
        """Epoch of the most recently returned batch (0 before the first batch)."""
        if self._position == 0 and self._epoch > 0:
            return self._epoch - 1
        return self._epoch

    def peek_epoch(self) -> int:
        """Epoch that the next :meth:`next_batch` call will draw from."""
        return self._epoch

    def permutation(self, epoch: int) -> list[int]:
        """The order in which epoch ``epoch`` visits the items."""
        return [int(i) for i in self._permutation(epoch)]

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch or self._perm is None:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, int(epoch)])
                self._perm = rng.permutation(self.num_items)
            else:
                self._perm = np.arange(self.num_items)
            self._perm_epoch = epoch
        return self._perm

    # ----------------------------------------------------------------------------------------------

    def next_batch(self) -> tuple[int, list[int]]:
        """Return ``(epoch, indices)`` for the next batch and advance."""
        epoch = self._epoch
        perm = self._permutation(epoch)
        start = self._position
        indices = [int(i) for i in perm[start : start + self.batch_size]]
        self._position = start + self.batch_size
        if self._position + self.batch_size > self.num_items:  # no full batch left: next epoch
            self._epoch += 1
            self._position = 0
        return epoch, indices

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        while True:
            yield self.next_batch()

    # ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Position of the next batch, plus the settings used to check a restore."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict`).

        Only ``epoch`` and ``position`` are required. If the state records ``num_items``, ``seed``
        or ``shuffle`` and they differ from this stream's, the batches could not be reproduced and
        a ValueError is raised. ``batch_size`` may differ: the stream continues from the same item
        offset (moving to the next epoch if no full batch fits).
        """
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"not a PromptStream state dict (needs integer 'epoch' and 'position'): {state!r}"
            ) from exc
        for key in ("num_items", "seed", "shuffle"):
            if key in state and state[key] is not None and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the prompt stream: the checkpoint has {key}={state[key]!r} but "
                    f"this run has {key}={getattr(self, key)!r}. Fix: resume with the same dataset "
                    "and data seed/shuffle settings as the checkpointed run."
                )
        if epoch < 0 or position < 0 or position > self.num_items:
            raise ValueError(
                f"invalid PromptStream state: epoch={epoch}, position={position} (num_items={self.num_items})."
            )
        if position + self.batch_size > self.num_items:
            epoch, position = epoch + 1, 0
        self._epoch = epoch
        self._position = position

    def __repr__(self) -> str:
        return (
            f"PromptStream(num_items={self.num_items}, batch_size={self.batch_size}, "
            f"seed={self.seed}, shuffle={self.shuffle}, epoch={self._epoch}, "
            f"position={self._position})"
        )
