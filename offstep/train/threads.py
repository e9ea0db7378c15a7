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
        """Take the count at the start of each of ``layers``' forward and backward passes (a CPU
        backward runs on the thread that started it). Taking it in the backward too matters: a
        micro-batch's backward is about two thirds of its pass, and an update may be one or two
        micro-batches, so cores lent during a backward would otherwise wait for the next forward."""
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: self.apply())
            layer.register_full_backward_pre_hook(lambda *_: self.apply())
