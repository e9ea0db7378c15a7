"""A replica's side of delta weight syncs (``pipeline.weight_sync_delta``; ``offstep.sync.delta``).

The built-in engine without LoRA applies a delta straight into the parameters it generates with.
An engine that loads weights through its own path (vLLM, which processes what it loads; LoRA
adapters, which may be merged into the base) keeps a host copy of the last weights it loaded, in
the manifest's dtypes; a delta is applied to that copy, which is then loaded whole: the transfer is
small, the load is not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from offstep.sync.delta import Delta, DeltaRefused, apply, fingerprint
from offstep.sync.digest import WeightDigest


class DeltaLoads:
    def __init__(self, engine, in_place: bool):
        self.engine, self.in_place = engine, in_place
        self.held_fp: int | None = None  # the fingerprint of the digest of what the engine holds
        self.host: dict[str, torch.Tensor] | None = None  # not in place: the last weights loaded
        self.wanted = False  # a delta came: keep host copies from now on (none without deltas)

    def held(self, digest: WeightDigest) -> None:
        """The digest of what the engine holds after a load (the base the next delta must name)."""
        self.held_fp = fingerprint(digest)

    def loaded_full(self, specs: list, tensors: Mapping[str, torch.Tensor]) -> None:
        """A full load: an engine with its own loader keeps a copy for the deltas that follow."""
        if not self.in_place and self.wanted:
            self.host = {
                s.name: tensors[s.name].detach().to(getattr(torch, s.dtype)).reshape(s.shape).clone() for s in specs
            }

    def loader(self, delta: Delta, version: int, specs: list, load: Callable[[dict, int], None]) -> Callable[[], None]:
        """The function that applies ``delta`` as ``version`` (``DeltaRefused`` before any write
        when it does not fit); ``load(tensors, version)`` loads full tensors (not in place)."""
        self.wanted = True

        def run() -> None:
            if self.in_place:
                model = self.engine.model
                apply(delta, specs, model.get_parameter, self.held_fp)
                self.engine.version = int(version)
                self.engine.reset_cache()
                return
            if self.host is None:
                raise DeltaRefused(
                    f"a delta to version {version} reached a replica that keeps no copy of its "
                    "weights yet (it does after a full sync that follows a delta); it needs a full sync"
                )
            apply(delta, specs, self.host.__getitem__, self.held_fp)
            load(self.host, version)

        return run
