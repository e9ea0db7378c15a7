"""What every trainer role shares: an FSDP2-sharded transformers model, the optimizer with
warm-up, and the data-parallel split of a batch. The forward pass over a ``TrainBatch`` is
``offstep.models.forward`` (the rollout side uses it too)."""

from __future__ import annotations

import functools
import math
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from offstep.batch import Span, TrainBatch, micro_batches, scatter_rows
from offstep.config.choices import NONFINITE_POLICIES
from offstep.config.schema import OptimConfig
from offstep.errors import NonFiniteError
from offstep.models.forward import forward_response
from offstep.models.lora import base_of
from offstep.models.vision import decoder_layers
from offstep.train.distributed import GroupSpec, all_max, all_sum, setup
from offstep.train.lr_schedule import LrSchedule
from offstep.train.shards import divides, local_mini, shard_plan, take_rows, unshard
from offstep.train.threads import ThreadLease


def shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer, then the root (embeddings, norm, head). A peft model is
    sharded the same way (its decoder layers hold the frozen base weights and the adapters side by
    side; FSDP2 shards each parameter on its own, so frozen and trainable ones share a unit)."""
    for layer in decoder_layers(base_of(model)):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_optimizer(params, cfg: OptimConfig):
    """AdamW over the parameters that train (all of them, or a LoRA model's adapters), fused: one
    kernel over every tensor instead of torch's per-tensor loop, about 9x faster on a CPU core
    (``benchmarks/update_throughput.py``), equal to it within float32 rounding (a few ulp;
    ``tests/train/test_optimizer.py``). The learning rate follows ``offstep.train.lr_schedule``; the
    caller sets the schedule's horizon (returned third) once it knows the run's optimizer steps."""
    opt = torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        fused=True,
    )
    schedule = LrSchedule(max(0, cfg.warmup_steps), cfg.lr_scheduler_type, cfg.min_lr_ratio, cfg.num_cycles)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: schedule(step))
    return opt, sched, schedule


def clip_and_step(
    model,
    opt,
    sched,
    max_norm: float,
    loss: float = 0.0,
    nonfinite: str = "skip",
    where: str = "an update",
    role: str = "actor",
) -> tuple[float, bool]:
    """Clip gradients and take one optimizer step, unless the loss or the gradient norm is not
    finite. Returns ``(grad_norm, stepped)``.

    A non-finite update never reaches the weights or the optimizer's moments (like the skipped
    steps of a mixed-precision grad scaler): the gradients are dropped and the learning-rate
    schedule still advances, so a skipped step keeps its place in the schedule. With
    ``nonfinite="stop"`` it raises :class:`NonFiniteError` instead, naming ``where`` and the
    ``role`` whose ``<role>.nonfinite`` key chose it. The
    gradient norm is global (FSDP2 reduces it over ranks) and the loss check is reduced over
    ranks, so every rank takes the same decision.
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"{role}.nonfinite={nonfinite!r} is not one of {list(NONFINITE_POLICIES)}")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    loss_ok = math.isfinite(float(loss))
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank takes the same decision
        loss_ok = all_sum(0.0 if loss_ok else 1.0, norm.device) == 0.0
    norm, loss = float(norm), float(loss)
    stepped = math.isfinite(norm) and loss_ok
    if stepped:
        opt.step()
    opt.zero_grad(set_to_none=True)
    if not stepped and nonfinite == "stop":
        raise NonFiniteError(
            f"non-finite values at {where}: loss={loss}, grad_norm={norm}; the run stops because "
            f"{role}.nonfinite=stop. Fix: find the cause (too high a {role}.optim.lr, extreme rewards, "
            f"bfloat16 overflow in model.compute_dtype), or set {role}.nonfinite=skip to skip such "
            f"updates (they are counted in {role}/skipped_steps)."
        )
    with warnings.catch_warnings():  # a skipped first step makes torch warn about the call order
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        sched.step()
    return norm, stepped


def rank_shard(batch: TrainBatch, rank: int, world: int) -> TrainBatch:
    """This rank's contiguous share of the batch (data parallel)."""
    if world == 1:
        return batch
    per = len(batch) // world
    return batch.select(slice(rank * per, (rank + 1) * per))


class RoleWorker:
    """Base of the actor, reference and critic workers: joins the group, owns the device."""

    def __init__(self, spec: GroupSpec, seed: int):
        self.spec = spec
        self.device, self.mesh = setup(spec)
        torch.manual_seed(seed)
        self.threads = ThreadLease(spec.num_threads)

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """``shard_model``, with each decoder layer taking the rank's thread count first."""
        self.threads.follow(decoder_layers(base_of(model)))
        return shard_model(model, self.mesh)

    def lend_threads(self, cores: int) -> None:
        """Cores an idle rollout worker lends this rank, 0 to give them back (``pipeline.lend_cores``;
        served beside a running call, in the actor's ``LEND_GROUP``)."""
        self.threads.lend(cores)

    @property
    def rank(self) -> int:
        return self.spec.rank

    def _local(self, batch: TrainBatch, mini: int = 0) -> TrainBatch:
        """This rank's rows of ``batch`` (``offstep.train.shards``: padded with filler rows where the
        batch or its mini-batch of ``mini`` rows, 0 for one, does not divide over the ranks)."""
        world, mini = self.spec.world_size, mini or len(batch)
        self._plan = None if divides(len(batch), world, mini) else shard_plan(len(batch), world, mini)
        if self._plan is None:
            return rank_shard(batch, self.spec.rank, world).to(self.device)
        return take_rows(batch, self._plan[self.spec.rank]).to(self.device)

    def _local_mini(self, batch: TrainBatch, mini: int) -> int:
        """Rows of this rank's mini-batches under ``_local(batch, mini)``."""
        return local_mini(len(batch), self.spec.world_size, mini or len(batch))

    def _micro_batches(
        self, batch: TrainBatch, micro: int, token_budget: int, share_prompts: bool = False
    ) -> list[tuple[torch.Tensor, TrainBatch]]:
        """(row indices, micro-batch) pairs of this rank's (mini-)batch: ``micro`` rows each, or
        budget-planned and trimmed (``offstep.batch.micro_batches``; ``share_prompts``: planned by
        prompt), with the same number of micro-batches on every rank so that FSDP's per-pass
        collectives pair up."""
        parts = micro_batches(batch, micro, token_budget, share_prompts=share_prompts)
        if token_budget > 0 and self.spec.world_size > 1:
            count = int(all_max(len(parts), self.device))
            if count > len(parts):
                parts = micro_batches(batch, micro, token_budget, min_count=count, share_prompts=share_prompts)
        return parts

    @torch.no_grad()
    def _logprobs(
        self,
        model,
        batch: TrainBatch,
        temperature: float,
        micro: int,
        compute_dtype: str,
        token_budget: int = 0,
        share_prompts: bool = False,
    ) -> torch.Tensor:
        """Log-probs of the whole batch, gathered from every rank (rank 0 returns them)."""
        local = self._local(batch)
        was_training = model.training
        model.eval()  # no dropout (e.g. LoRA's) in a log-prob pass: the policy itself, not a sample of it
        try:
            parts = [
                (
                    idx,
                    forward_response(model, mb, temperature, compute_dtype=compute_dtype, share_prompts=share_prompts)[
                        0
                    ],
                )
                for idx, mb in self._micro_batches(local, micro, token_budget, share_prompts)
            ]
        finally:
            model.train(was_training)
        return self._gather(scatter_rows(parts, len(local), local.response_mask.shape[1]), len(batch))

    def _denominator(self, mb: TrainBatch, loss_agg_mode: str) -> float:
        """This rank's share of a mini-batch's loss normaliser (global tokens for token-mean,
        none for token-sum, global sequences otherwise): FSDP2 averages gradients over ranks, so
        dividing by global / world gives exactly the mini-batch's loss."""
        if loss_agg_mode == "token-sum":
            return 1.0 / self.spec.world_size
        valid = mb.response_mask.sum(-1)  # sequences with a valid token, as aggregate_loss counts (no filler)
        count = float(valid.sum()) if loss_agg_mode == "token-mean" else float((valid > 0).sum())
        return all_sum(count, self.device) / self.spec.world_size

    def _gather(self, t: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Every rank's rows of ``t`` (this rank's under the last ``_local``), in the batch's order."""
        if self.spec.world_size == 1:
            return t.cpu()
        out = [torch.empty_like(t) for _ in range(self.spec.world_size)]
        dist.all_gather(out, t.contiguous())
        whole = torch.cat(out).cpu()
        plan = getattr(self, "_plan", None)
        return whole if rows is None or plan is None else unshard(whole, plan, rows)

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        """Unsharded weights on CPU (on rank 0; other ranks get an empty dict)."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # Counters a role keeps across steps (e.g. the actor's skipped steps) that a checkpoint holds.
    _checkpointed_attrs: tuple[str, ...] = ()

    def save_checkpoint(self, path: str) -> None:
        from offstep.train.checkpoint import save_role

        extra = {a: getattr(self, a) for a in self._checkpointed_attrs}
        save_role(path, self.rank, self.model, getattr(self, "opt", None), getattr(self, "sched", None), extra)

    def load_checkpoint(self, path: str) -> None:
        from offstep.train.checkpoint import load_role

        extra = load_role(path, self.rank, self.model, getattr(self, "opt", None), getattr(self, "sched", None))
        for a in self._checkpointed_attrs:  # only the counters this role writes, whatever the file holds
            if a in extra:
                setattr(self, a, extra[a])

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def timed(fn):
    """Wrap a worker method so it returns ``(result, Span)``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.time()
        res = fn(*args, **kwargs)
        return res, Span(t0, time.time())

    return wrapper
