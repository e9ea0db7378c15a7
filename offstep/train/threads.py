"""A trainer rank's torch threads: its own cores, plus the cores that an idle rollout worker lends
it (``pipeline.lend_cores``; the driver's side is ``offstep.pipeline.lending``).

``lend`` is called from another thread (the rank's Ray actor serves it in a concurrency group of
its own, while the rank computes); the compute thread takes the new count at its next decoder
layer. OpenMP's thread count is per calling thread, so only the compute thread may set it."""

from __future__ import annotations

import torch


class ThreadLease:
    def __init__(self, own: int):
        self.own = max(1, int(own))
        self.lent = 0

    def lend(self, cores: int) -> None:
        self.lent = max(0, int(cores))

    def apply(self) -> None:
        want = self.own + self.lent
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def follow(self, layers) -> None:
        """Take the count at the start of each of ``layers``' forward passes (a backward pass runs on
        the thread that started it, with the count its forward left)."""
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: self.apply())
