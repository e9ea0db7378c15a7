"""The actor role: the policy being trained, FSDP2-sharded over the trainer pool.

One update consumes a batch that already carries advantages (and reference log-probs when KL is
a loss). The "old" log-probs of the ratio depend on ``algorithm.correction_mode``: in ``bypass``
mode they are the rollout's own (set by the controller); otherwise they are the trainer's, and
when the batch is consumed in one mini-batch and one epoch they come from the same forward pass
(detached), which saves a forward pass; else the controller asks for them first
(``compute_logprobs``). In ``decoupled`` mode the gap between the trainer's and the rollout's
log-probs is corrected by truncated importance weights and rejection masks
(``offstep.algos.correction``), and optionally M2PO's second-moment mask, chosen over each whole
mini-batch, with their metrics overall and per staleness.
"""

from __future__ import annotations

import copy

import numpy as np
import ray
import torch
import torch.distributed as dist

from offstep.algos.common import aggregate_loss, masked_mean
from offstep.algos.correction import (
    GroupedTokenStats,
    m2po_mask,
    mismatch_kl_terms,
    rejection_mask,
    truncated_flags,
    truncated_importance_weights,
)
from offstep.algos.distill import topk_forward_kl
from offstep.algos.losses import kl_penalty
from offstep.algos.policy_losses import policy_loss
from offstep.batch import TrainBatch
from offstep.config.schema import ActorConfig, AlgorithmConfig, DistillConfig
from offstep.models.forward import DTYPES, entropy_from_logits, forward_response, logprobs_from_logits, response_logits
from offstep.models.loading import load_causal_lm
from offstep.models.lora import add_adapters, is_adapter_name
from offstep.models.vision import freeze_vision_tower
from offstep.sync.collective import WeightSender, full_parameters, manifest
from offstep.sync.delta import DeltaSender
from offstep.sync.digest import WeightDigest, digest_of
from offstep.sync.weights import pack_state_dict
from offstep.telemetry.names import Stage
from offstep.telemetry.progress import ProgressClient, mini_batch_count
from offstep.train.distributed import GroupSpec, all_mean
from offstep.train.fsdp import RoleWorker, clip_and_step, make_optimizer, timed


class ActorWorker(RoleWorker):
    _checkpointed_attrs = ("skipped_steps", "updates")

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
        progress: ProgressClient | None = None,
        reference: bool = False,
        distill: DistillConfig | None = None,
        total_steps: int = 0,
    ):
        """``distill``: with ``loss_mode=forward_kl_topk``, the teacher's top-k term is added to the loss.
        ``total_steps``: the run's updates (``trainer.total_steps``), the horizon of a decaying learning rate."""
        super().__init__(spec, seed)
        self.cfg, self.algo, self.temperature, self.total_steps = actor, algo, temperature, total_steps
        self.distill = (
            distill if distill is not None and distill.enabled and distill.loss_mode == "forward_kl_topk" else None
        )
        self.compute_dtype = compute_dtype
        model = load_causal_lm(model_path, dtype=DTYPES[dtype]).to(self.device)
        # LoRA: the base frozen, adapters trained; the reference is this model with them off.
        self.lora = actor.lora.rank > 0
        # ``reference`` (without LoRA): a frozen copy of the initial policy lives beside it, in this
        # process, sharded the same way (as verl's fused actor-and-reference worker), rather than
        # in a reference role's process of its own.
        self.ref_model = None
        if reference and not self.lora:
            ref_model = copy.deepcopy(model).requires_grad_(False).eval()
            self.ref_model = self._shard(ref_model)
        if actor.freeze_vision_tower:  # with LoRA too: the base, tower included, is frozen anyway
            freeze_vision_tower(model)
        if self.lora:
            model = add_adapters(model, actor.lora)
        # What a weight sync carries: every parameter, or the adapters only.
        self._synced = is_adapter_name if self.lora else None
        model.train()
        self.model = self._shard(model)
        self.opt, self.sched, self.schedule = make_optimizer(self.model.parameters(), actor.optim)
        self.skipped_steps = 0
        # Live progress from rank 0 only (all ranks step together); a no-op without a hub.
        self.progress = progress if progress is not None and self.rank == 0 else ProgressClient()
        self.updates = 0  # update() calls so far: the step number, for error messages
        self._by_staleness: GroupedTokenStats | None = None  # correction metrics per staleness

    def _forward_args(self) -> tuple:
        """How a log-prob pass runs: micro-batch rows, compute dtype, token budget, shared prompts."""
        cfg = self.cfg
        return cfg.micro_batch_size, self.compute_dtype, cfg.micro_token_budget, cfg.share_prompts

    @timed
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._logprobs(self.model, batch, self.temperature, *self._forward_args())

    @timed
    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The reference policy's log-probs: the frozen copy's (``reference``), or with LoRA this
        model with its adapters switched off (the base weights, which never train)."""
        args = (batch, self.temperature, *self._forward_args())
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, *args)
        with self.model.disable_adapter():
            return self._logprobs(self.model, *args)

    def _correction(self, mb: TrainBatch, logp: torch.Tensor, m2po: tuple | None = None):
        """The old log-probs of the ratio, the per-token weights on the policy loss (or None), and
        the correction metrics, per ``algorithm.correction_mode`` (see ``AlgorithmConfig``).
        ``m2po``: this micro-batch's rows of its mini-batch's M2PO mask and that mask's metrics
        (``_m2po``); None with M2PO on: the micro-batch is masked alone."""
        algo, mask = self.algo, mb.response_mask
        if algo.correction_mode == "bypass":
            # the rollout's log-probs are the old policy; the diagnostics compare the policy of
            # this forward pass (the pre-update one on the first mini-batch) with the rollout
            old = mb.old_logprobs if mb.old_logprobs is not None else mb.rollout_logprobs
            probe = logp.detach()
        else:
            old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
            probe = old
        k1, k3 = mismatch_kl_terms(probe, mb.rollout_logprobs, mask)
        metrics = {"mismatch_kl_k1": masked_mean(k1, mask), "mismatch_kl_k3": masked_mean(k3, mask)}
        per_token = {"mismatch_kl_k1": k1, "mismatch_kl_k3": k3}
        weights = None
        if algo.correction_mode == "decoupled":
            if algo.tis:
                weights, tis_metrics = truncated_importance_weights(
                    old, mb.rollout_logprobs, mask, cap=algo.tis_cap, level=algo.tis_level
                )
                metrics.update(tis_metrics)
                per_token["is_weight_mean"] = weights
                per_token["is_truncated_frac"] = truncated_flags(
                    old, mb.rollout_logprobs, mask, algo.tis_cap, algo.tis_level
                )
            if algo.rejection_level != "off" or algo.rejection_kl > 0:
                keep, rej_metrics = rejection_mask(
                    old,
                    mb.rollout_logprobs,
                    mask,
                    level=algo.rejection_level,
                    ratio_high=algo.rejection_ratio_high,
                    ratio_low=algo.rejection_ratio_low or None,
                    kl_threshold=algo.rejection_kl or None,
                )
                weights = keep if weights is None else weights * keep
                metrics.update(rej_metrics)
                per_token["rejected_frac"] = mask - keep
            if algo.m2po_threshold > 0:
                if m2po is None:
                    adv = mb.advantages if algo.m2po_tokens == "trust_region" else None
                    keep, m2_metrics = m2po_mask(old, mb.rollout_logprobs, mask, algo.m2po_threshold, adv)
                else:
                    keep, m2_metrics = m2po
                    m2_metrics = {**m2_metrics, "m2po_masked_frac": masked_mean(mask - keep, mask)}
                weights = keep if weights is None else weights * keep
                metrics.update(m2_metrics)
                per_token["m2po_masked_frac"] = mask - keep
        if mb.staleness is not None and self._by_staleness is not None:
            self._by_staleness.add(per_token, mask, mb.staleness)
        return old, weights, metrics

    def _m2po(self, mini: TrainBatch) -> tuple | None:
        """M2PO's keep mask [b, R] for this rank's rows of a mini-batch, chosen over every rank's
        tokens of it, and its metrics; None when off, or when the old log-probs come from each
        micro-batch's own forward pass (``needs_old_logprobs`` asks for them first with M2PO on)."""
        algo = self.algo
        if algo.correction_mode != "decoupled" or algo.m2po_threshold <= 0 or mini.old_logprobs is None:
            return None
        adv = mini.advantages if algo.m2po_tokens == "trust_region" else None
        gather = self._gather_flat if dist.is_initialized() and dist.get_world_size() > 1 else None
        keep, metrics = m2po_mask(
            mini.old_logprobs, mini.rollout_logprobs, mini.response_mask, algo.m2po_threshold, adv, gather=gather
        )
        return keep, {k: metrics[k] for k in ("m2po_m2", "m2po_m2_kept")}

    @staticmethod
    def _gather_flat(local: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's flat tensor, concatenated in rank order, and this rank's offset in it."""
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local.detach().cpu())
        return torch.cat(parts), sum(p.numel() for p in parts[: dist.get_rank()])

    @staticmethod
    def _staleness_stats(batch: TrainBatch) -> GroupedTokenStats | None:
        if batch.staleness is None:
            return None
        levels = sorted(set(batch.staleness.tolist()))  # the whole batch's: the same on every rank
        return GroupedTokenStats(levels, "staleness", max_of={"is_weight_mean": "is_weight_max"})

    def _staleness_metrics(self) -> dict[str, float]:
        """The correction metrics per staleness, e.g. ``mismatch_kl_k1/staleness_1``: token sums
        and counts summed over ranks (every rank reports the same levels: those of the batch)."""
        stats, self._by_staleness = self._by_staleness, None
        if stats is None or not stats.levels:
            return {}
        sums, maxes = stats.totals()
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor(sums, dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            sums = t.tolist()
            if maxes:
                t = torch.tensor(maxes, dtype=torch.float64, device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                maxes = t.tolist()
        return stats.metrics(sums, maxes)

    def _micro_step(self, mb: TrainBatch, denom: float, m2po: tuple | None = None) -> dict[str, float]:
        algo, mask = self.algo, mb.response_mask
        logits = None
        if self.distill is not None and mb.teacher_topk_ids is not None:  # the whole vocabulary is needed
            logits = response_logits(self.model, mb, self.temperature, self.compute_dtype, self.cfg.share_prompts)
            logp, ent = logprobs_from_logits(logits, mb.responses), entropy_from_logits(logits)
        else:
            logp, ent = forward_response(
                self.model, mb, self.temperature, True, self.compute_dtype, self.cfg.share_prompts
            )
        old, weights, metrics = self._correction(mb, logp, m2po)
        horizon = (
            algo.loss_agg_horizon or None
        )  # Dr. GRPO's constant (load_config resolves 0 to rollout.max_new_tokens)

        def reduce(per_token: torch.Tensor, is_weights: torch.Tensor | None = None) -> torch.Tensor:
            """The one reduction of every loss term, normalised by the whole mini-batch (``denom``)."""
            return aggregate_loss(
                per_token, mask, algo.loss_agg_mode, denom=denom, horizon=horizon, is_weights=is_weights
            )

        per_token, pg_metrics = policy_loss(
            algo.policy_loss,
            logp,
            old,
            mb.advantages,
            mask,
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            clip_ratio_c=algo.clip_ratio_c,
        )
        pg_loss = reduce(per_token, weights)
        loss = pg_loss
        metrics.update(pg_metrics)
        if mb.ref_logprobs is not None:
            kl = kl_penalty(logp, mb.ref_logprobs, kind=algo.kl_estimator)
            metrics["kl"] = masked_mean(kl.detach(), mask)
            if algo.use_kl_loss:
                loss = loss + algo.kl_coef * reduce(kl)
        if algo.entropy_coeff:
            loss = loss - algo.entropy_coeff * reduce(ent)
        if logits is not None:  # distill.loss_mode=forward_kl_topk: the teacher's top-k, the student's on its ids
            ids = mb.teacher_topk_ids.clamp(max=logits.shape[-1] - 1)
            student = torch.log_softmax(logits, -1).gather(-1, ids)
            kd = topk_forward_kl(mb.teacher_topk_logprobs, student, mask)
            metrics["distill_topk_kl"] = masked_mean(kd.detach(), mask)
            loss = loss + self.distill.coef * reduce(kd)
        loss.backward()
        self.progress.advance()
        metrics["entropy"] = masked_mean(ent.detach(), mask)
        metrics["pg_loss"] = pg_loss.detach()
        metrics["loss"] = loss.detach()
        return {k: float(v) for k, v in metrics.items()}

    @timed
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """PPO epochs over mini-batches of micro-batches; returns metrics averaged over ranks."""
        local = self._local(batch, self.cfg.mini_batch_size)
        mini = self._local_mini(batch, self.cfg.mini_batch_size)
        sums: dict[str, float] = {}
        n_mini = 0
        self.updates += 1
        self._by_staleness = self._staleness_stats(batch)
        minis = mini_batch_count(len(local), mini, self.cfg.ppo_epochs)
        self.schedule.horizon = self.total_steps * minis  # the same every update: the batch's size is fixed
        self.progress.start(Stage.UPDATE_ACTOR, minis=minis)
        for epoch in range(self.cfg.ppo_epochs):
            for j, mini_batch in enumerate(local.chunks(mini)):
                denom = self._denominator(mini_batch, self.algo.loss_agg_mode)
                m2po = self._m2po(mini_batch)
                parts = self._micro_batches(
                    mini_batch, self.cfg.micro_batch_size, self.cfg.micro_token_budget, self.cfg.share_prompts
                )
                micros = [mb for _, mb in parts]
                self.progress.plan(len(micros))
                micro_metrics = [
                    self._micro_step(
                        mb,
                        denom,
                        None
                        if m2po is None
                        else (m2po[0][idx.to(m2po[0].device), : mb.response_mask.shape[1]], m2po[1]),
                    )
                    for idx, mb in parts
                ]
                n_tok = [float(mb.response_mask.sum()) for mb in micros]
                for key in micro_metrics[0]:
                    vals = [m[key] for m in micro_metrics]
                    # pg_loss and loss are already scaled by the mini-batch normaliser: summing gives
                    # this rank's share of the mini-batch loss. Other metrics are token-weighted means.
                    if key in ("pg_loss", "loss"):
                        v = sum(vals)
                    elif key.endswith("_max"):
                        v = max(vals)
                    else:
                        v = float(np.average(vals, weights=n_tok)) if sum(n_tok) else 0.0
                    sums[key] = sums.get(key, 0.0) + v
                where = f"the actor update of step {self.updates} (epoch {epoch + 1}, mini-batch {j + 1})"
                loss = sum(m["loss"] for m in micro_metrics)
                norm, stepped = clip_and_step(
                    self.model, self.opt, self.sched, self.cfg.optim.grad_clip, loss, self.cfg.nonfinite, where
                )
                self.skipped_steps += 0 if stepped else 1
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + norm
                n_mini += 1
        metrics = {k: v / n_mini for k, v in sums.items()}
        metrics["lr"] = self.sched.get_last_lr()[0]
        metrics["skipped_steps"] = float(self.skipped_steps)
        metrics.update(self._staleness_metrics())
        return all_mean(metrics, self.device)

    def set_sync_manifest(self, specs: list, full_every: int = 0) -> None:
        """The rollout side's sync manifest (``RolloutWorker.weight_sync_manifest``): what every
        export's digest covers, in the rollout's names, order and dtypes (``offstep.sync.digest``).
        ``full_every`` > 0: delta syncs, a full one every that many (``offstep.sync.delta``)."""
        self._sync_specs = list(specs)
        self._delta = DeltaSender(specs, full_every) if full_every > 0 and self.rank == 0 else None

    def export_weights(self, full: bool = False) -> list:
        """Full weights (with LoRA: the adapters only), put once into Ray's object store by rank
        0: ``[ref, digest]`` (or ``[]``); the digest of what was sent, over the rollout manifest
        (``None`` before :meth:`set_sync_manifest`). With delta syncs, the ref holds the change
        since the last export unless a full sync is due or ``full``."""
        if self.lora:  # every rank gathers the adapters' shards; the frozen base never travels
            sd = {name: t.cpu() for name, t in full_parameters(self.model, self._synced)}
        else:
            sd = self.full_state_dict(self.model)
        if self.rank != 0:
            return []
        specs = getattr(self, "_sync_specs", None)
        delta = getattr(self, "_delta", None)
        if delta is not None:
            cast = delta.cast(sd.__getitem__)
            sent = digest_of(specs, cast.__getitem__)
            d = delta.next(delta.base_version + 1, cast, sent, full, keep=False)
            return [ray.put(pack_state_dict(sd) if d is None else d), sent]
        return [ray.put(pack_state_dict(sd)), digest_of(specs, sd.__getitem__) if specs is not None else None]

    # Collective path (pipeline.weight_sync=collective): rank 0 is rank 0 of a group of its own with
    # every rollout worker, made by offstep.sync.collective.connect and made again when a rollout
    # worker is replaced.
    def open_weight_sync(self, timeout_s: float, host: str | None = None) -> tuple[str, int]:
        """Rank 0: serve a new weight-sync group's store on ``host`` (None: this node's address);
        returns its (host, port). A previous group's sender is kept until its broadcasts in flight
        are done (dropping a gloo group with work pending blocks until that work ends)."""
        old = getattr(self, "_weight_sender", None)
        self._retired = [s for s in getattr(self, "_retired", []) if not s.idle()] + ([old] if old is not None else [])
        self._weight_sender = WeightSender(host or ray.util.get_node_ip_address(), self.device, timeout_s)
        return self._weight_sender.endpoint

    def join_weight_sync(
        self, world_size: int, backend: str, specs: list, bucket_bytes: int, max_in_flight: int
    ) -> None:
        """Rank 0: join the group (blocks until every rollout worker has joined)."""
        self._weight_sender.connect(
            world_size, backend, specs, bucket_bytes, manifest(self.model, self._synced), max_in_flight
        )

    def send_weights(self, version: int, full: bool = False) -> WeightDigest | None:
        """Every rank gathers the full parameters (FSDP2); rank 0 broadcasts them to the rollout
        workers and returns the digest of what it sent (the snapshot, in the rollout's dtypes)."""
        sender = getattr(self, "_weight_sender", None)
        if sender is None:
            for _ in full_parameters(self.model, self._synced):
                pass
            return None
        sums = sender.send(full_parameters(self.model, self._synced), version, getattr(self, "_delta", None), full)
        specs = getattr(self, "_sync_specs", None)
        return None if specs is None else WeightDigest(tuple(s.name for s in specs), tuple(sums[s.name] for s in specs))
