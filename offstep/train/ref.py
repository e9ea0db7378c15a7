"""The reference role: a frozen copy of the initial policy, for the KL term."""

from __future__ import annotations

import torch

from offstep.batch import TrainBatch
from offstep.models.forward import DTYPES
from offstep.models.loading import load_causal_lm
from offstep.train.distributed import GroupSpec
from offstep.train.fsdp import RoleWorker, timed


class RefWorker(RoleWorker):
    def __init__(
        self, spec: GroupSpec, seed: int, model_path: str, dtype: str, compute_dtype: str, temperature: float, micro_batch_size: int,
        micro_token_budget: int = 0,
    ):
        super().__init__(spec, seed)
        model = load_causal_lm(model_path, dtype=DTYPES[dtype]).to(self.device)
        model.requires_grad_(False)
        self.model = self._shard(model)
        self.temperature, self.micro, self.compute_dtype = temperature, micro_batch_size, compute_dtype
        self.token_budget = micro_token_budget

    @timed
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._logprobs(self.model, batch, self.temperature, self.micro, self.compute_dtype, self.token_budget)
