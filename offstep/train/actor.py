"""The actor role: the policy being trained, FSDP2-sharded over the trainer pool.

One update consumes a batch that already carries advantages (and reference log-probs when KL is
a loss). When the batch is consumed in one mini-batch and one epoch, the "old" log-probs of the
PPO ratio are the current policy's own (detached) log-probs from the same forward pass, which
saves a forward pass; otherwise the controller asks for them first (``compute_logprobs``).
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from offstep.algos.common import aggregate_loss, masked_mean
from offstep.algos.correction import truncated_importance_weights
from offstep.algos.losses import clipped_policy_loss, kl_penalty
from offstep.batch import TrainBatch
from offstep.config.schema import ActorConfig, AlgorithmConfig
from offstep.models.loading import load_causal_lm
from offstep.sync.weights import pack_state_dict
from offstep.train.distributed import GroupSpec, all_mean
from offstep.train.fsdp import (
    DTYPES,
    RoleWorker,
    clip_and_step,
    forward_response,
    make_optimizer,
    shard_model,
    timed,
)


class ActorWorker(RoleWorker):
    def __init__(
        self,
        spec: GroupSpec,
        seed: int,
        model_path: str,
        dtype: str,
        compute_dtype: str,
        actor: ActorConfig,
        algo: AlgorithmConfig,
        temperature: float,
    ):
        super().__init__(spec, seed)
        self.cfg, self.algo, self.temperature = actor, algo, temperature
        self.compute_dtype = compute_dtype
        model = load_causal_lm(model_path, dtype=DTYPES[dtype]).to(self.device)
        model.train()
        self.model = shard_model(model, self.mesh)
        self.opt, self.sched = make_optimizer(self.model.parameters(), actor.optim)
        self.skipped_steps = 0

    @timed
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._logprobs(self.model, batch, self.temperature, self.cfg.micro_batch_size, self.compute_dtype)

    def _micro_step(self, mb: TrainBatch, denom: float) -> dict[str, float]:
        algo, mask = self.algo, mb.response_mask
        logp, ent = forward_response(self.model, mb, self.temperature, True, self.compute_dtype)
        old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
        is_w, metrics = None, {}
        if algo.tis:
            is_w, metrics = truncated_importance_weights(
                old, mb.rollout_logprobs, mask, cap=algo.tis_cap, level=algo.tis_level
            )
        pg_loss, pg_metrics = clipped_policy_loss(
            logp,
            old,
            mb.advantages,
            mask,
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            loss_agg_mode=algo.loss_agg_mode,
            denom=denom,
            is_weights=is_w,
        )
        loss = pg_loss
        metrics.update(pg_metrics)
        if mb.ref_logprobs is not None:
            kl = kl_penalty(logp, mb.ref_logprobs, kind=algo.kl_estimator)
            metrics["kl"] = masked_mean(kl.detach(), mask)
            if algo.use_kl_loss:
                loss = loss + algo.kl_coef * aggregate_loss(kl, mask, algo.loss_agg_mode, denom=denom)
        if algo.entropy_coeff:
            loss = loss - algo.entropy_coeff * aggregate_loss(
                ent, mask, algo.loss_agg_mode, denom=denom
            )
        loss.backward()
        metrics["entropy"] = masked_mean(ent.detach(), mask)
        metrics["pg_loss"] = pg_loss.detach()
        return {k: float(v) for k, v in metrics.items()}

    @timed
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """PPO epochs over mini-batches of micro-batches; returns metrics averaged over ranks."""
        local = self._local(batch)
        world = self.spec.world_size
        mini = (self.cfg.mini_batch_size or len(batch)) // world
        sums: dict[str, float] = {}
        n_mini = 0
        for _ in range(self.cfg.ppo_epochs):
            for mini_batch in local.chunks(mini):
                denom = self._denominator(mini_batch, self.algo.loss_agg_mode)
                micros = mini_batch.chunks(self.cfg.micro_batch_size)
                micro_metrics = [self._micro_step(mb, denom) for mb in micros]
                n_tok = [float(mb.response_mask.sum()) for mb in micros]
                for key in micro_metrics[0]:
                    vals = [m[key] for m in micro_metrics]
                    # pg_loss is already scaled by the mini-batch normaliser: summing gives this
                    # rank's share of the mini-batch loss. Other metrics are token-weighted means.
                    if key == "pg_loss":
                        v = sum(vals)
                    elif key.endswith("_max"):
                        v = max(vals)
                    else:
                        v = float(np.average(vals, weights=n_tok)) if sum(n_tok) else 0.0
                    sums[key] = sums.get(key, 0.0) + v
                norm, stepped = clip_and_step(self.model, self.opt, self.sched, self.cfg.optim.grad_clip)
                self.skipped_steps += 0 if stepped else 1
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + norm
                n_mini += 1
        metrics = {k: v / n_mini for k, v in sums.items()}
        metrics["lr"] = self.sched.get_last_lr()[0]
        metrics["skipped_steps"] = float(self.skipped_steps)
        return all_mean(metrics, self.device)

    def export_weights(self) -> list:
        """Full weights, put once into Ray's object store by rank 0: ``[ref]`` (or ``[]``)."""
        sd = self.full_state_dict(self.model)
        if self.rank != 0:
            return []
        return [ray.put(pack_state_dict(sd))]
