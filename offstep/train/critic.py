"""The critic role (PPO with GAE): the policy's backbone with a scalar value head.

The value of response token t is read at the position before it (the state that produced it),
as in verl's critic; the head is a fresh linear layer seeded by ``trainer.seed``. During the first
``critic.warmup_steps`` steps the controller updates only this role (critic warm-up), so the
values are trained before the actor follows their advantages.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForTokenClassification

from offstep.algos.losses import value_loss
from offstep.batch import TrainBatch, scatter_rows
from offstep.config.schema import AlgorithmConfig, CriticConfig
from offstep.models.forward import DTYPES, autocast
from offstep.telemetry.progress import mini_batch_count
from offstep.train.distributed import GroupSpec, all_mean
from offstep.train.fsdp import RoleWorker, clip_and_step, make_optimizer, timed


class CriticWorker(RoleWorker):
    _checkpointed_attrs = ("skipped_steps", "updates")

    def __init__(
        self,
        spec: GroupSpec,
        seed: int,
        model_path: str,
        dtype: str,
        compute_dtype: str,
        critic: CriticConfig,
        algo: AlgorithmConfig,
        micro_batch_size: int,
        mini_batch_size: int,
        micro_token_budget: int = 0,
        total_steps: int = 0,
    ):
        """``total_steps``: the run's updates, the horizon of a decaying learning rate (as the actor's)."""
        super().__init__(spec, seed)
        model = AutoModelForTokenClassification.from_pretrained(
            model_path, num_labels=1, dtype=DTYPES[dtype], attn_implementation="sdpa"
        ).to(self.device)
        model.train()
        self.model = self._shard(model)
        self.opt, self.sched, self.schedule = make_optimizer(self.model.parameters(), critic.optim)
        self.cfg, self.algo = critic, algo
        self.micro, self.mini, self.token_budget = micro_batch_size, mini_batch_size, micro_token_budget
        self.total_steps = total_steps
        self.compute_dtype = compute_dtype
        self.skipped_steps = 0  # optimizer steps skipped for non-finite loss or gradients
        self.updates = 0

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        R = mb.response_mask.shape[1]
        with autocast(mb.input_ids.device, self.compute_dtype):
            out = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
        return out.logits[:, -R - 1 : -1, 0].float() * mb.response_mask

    @timed
    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        local = self._local(batch)
        parts = [(idx, self._values(mb)) for idx, mb in self._micro_batches(local, self.micro, self.token_budget)]
        return self._gather(scatter_rows(parts, len(local), local.response_mask.shape[1]), len(batch))

    @timed
    def update(self, batch: TrainBatch) -> dict[str, float]:
        local = self._local(batch, self.mini)
        mini = self._local_mini(batch, self.mini)
        sums, n_mini = {}, 0
        self.updates += 1
        self.schedule.horizon = self.total_steps * mini_batch_count(len(local), mini, self.cfg.ppo_epochs)
        for epoch in range(self.cfg.ppo_epochs):
            for j, mini_batch in enumerate(local.chunks(mini)):
                denom = self._denominator(mini_batch, self.algo.loss_agg_mode)
                losses, clips, toks = [], [], []
                for _, mb in self._micro_batches(mini_batch, self.micro, self.token_budget):
                    v = self._values(mb)
                    loss, m = value_loss(
                        v,
                        mb.values,
                        mb.returns,
                        mb.response_mask,
                        clip_range=self.cfg.value_clip,
                        loss_agg_mode=self.algo.loss_agg_mode,
                        denom=denom,
                        horizon=self.algo.loss_agg_horizon or None,
                    )
                    loss.backward()
                    losses.append(float(loss))
                    clips.append(float(m["vf_clipfrac"]))
                    toks.append(float(mb.response_mask.sum()))
                where = f"the critic update of step {self.updates} (epoch {epoch + 1}, mini-batch {j + 1})"
                norm, stepped = clip_and_step(
                    self.model,
                    self.opt,
                    self.sched,
                    self.cfg.optim.grad_clip,
                    sum(losses),
                    self.cfg.nonfinite,
                    where,
                    role="critic",
                )
                self.skipped_steps += 0 if stepped else 1
                for k, v in (
                    ("vf_loss", sum(losses)),
                    ("vf_clipfrac", float(np.average(clips, weights=toks)) if sum(toks) else 0.0),
                    ("grad_norm", norm),
                ):
                    sums[k] = sums.get(k, 0.0) + v
                n_mini += 1
        metrics = all_mean({k: v / n_mini for k, v in sums.items()}, self.device)
        metrics["skipped_steps"] = float(self.skipped_steps)
        return metrics
