"""Checks a config before any process starts: every message names the key and the fix."""

from __future__ import annotations

import os
from pathlib import Path

from offstep.config.loader import ConfigError
from offstep.config.schema import Config

ADV_ESTIMATORS = ("grpo", "gae")
KL_ESTIMATORS = ("k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _need(ok: bool, msg: str, errors: list[str]) -> None:
    if not ok:
        errors.append(msg)


def _choice(value, key: str, choices, errors: list[str]) -> None:
    _need(value in choices, f"{key}={value!r} is not one of {list(choices)}", errors)


def available_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - torch import problems surface elsewhere
        return 0


def validate(cfg: Config, cpu_count: int | None = None, gpu_count: int | None = None) -> None:
    """Raise ``ConfigError`` listing every problem found (cheap: nothing is loaded)."""
    from offstep.models.loading import ModelError, check_model_path

    e: list[str] = []
    k = cfg.pipeline.max_staleness
    _need(k >= 0, f"pipeline.max_staleness={k} must be >= 0 (0: synchronous, 1: one-step off-policy)", e)
    _need(not (cfg.pipeline.colocate and k > 0), "pipeline.colocate=true needs pipeline.max_staleness=0: "
          "overlapping generation with training needs disjoint pools", e)
    _need(cfg.trainer.total_steps >= 1, f"trainer.total_steps={cfg.trainer.total_steps} must be >= 1", e)
    _need(cfg.trainer.val_freq >= 0, f"trainer.val_freq={cfg.trainer.val_freq} must be >= 0 (0: before and after only)", e)
    _choice(cfg.trainer.device, "trainer.device", ("auto", "cpu", "cuda"), e)
    _choice(cfg.trainer.progress, "trainer.progress", ("auto", "bar", "plain", "off"), e)
    from offstep.telemetry.loggers import KNOWN as LOGGERS

    for name in cfg.trainer.loggers:
        _choice(name, "trainer.loggers entry", LOGGERS, e)
    for key, v in (("model.dtype", cfg.model.dtype), ("model.compute_dtype", cfg.model.compute_dtype), ("rollout.dtype", cfg.rollout.dtype)):
        _choice(v, key, ("float32", "bfloat16"), e)
    _choice(cfg.data.overlong_prompts, "data.overlong_prompts", ("filter", "error"), e)
    _choice(cfg.algorithm.adv_estimator, "algorithm.adv_estimator", ADV_ESTIMATORS, e)
    _choice(cfg.algorithm.kl_estimator, "algorithm.kl_estimator", KL_ESTIMATORS, e)
    _choice(cfg.algorithm.loss_agg_mode, "algorithm.loss_agg_mode", LOSS_AGG_MODES, e)
    _choice(cfg.algorithm.tis_level, "algorithm.tis_level", ("token", "sequence"), e)

    r, d, a = cfg.rollout, cfg.data, cfg.actor
    _need(r.n >= 1, f"rollout.n={r.n} must be >= 1", e)
    _need(not (cfg.algorithm.adv_estimator == "grpo" and r.n < 2),
          f"algorithm.adv_estimator=grpo normalises rewards within a group of samples of one prompt, so it "
          f"needs rollout.n >= 2 (got {r.n}); set rollout.n=4, or use algorithm.adv_estimator=gae", e)
    _need(r.temperature >= 0, f"rollout.temperature={r.temperature} must be >= 0", e)
    _need(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]", e)
    _need(r.top_k >= 0, f"rollout.top_k={r.top_k} must be >= 0 (0 disables it)", e)
    _need(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1", e)
    _need(r.replicas >= 1, f"rollout.replicas={r.replicas} must be >= 1", e)
    _need(d.train_batch_size >= r.replicas,
          f"data.train_batch_size={d.train_batch_size} must be >= rollout.replicas={r.replicas} "
          f"(each replica answers at least one prompt)", e)
    _need(d.max_prompt_length >= 1, f"data.max_prompt_length={d.max_prompt_length} must be >= 1", e)

    W = cfg.resources.trainer_workers
    B = d.train_batch_size * r.n
    _need(W >= 1, f"resources.trainer_workers={W} must be >= 1", e)
    _need(a.micro_batch_size >= 1, f"actor.micro_batch_size={a.micro_batch_size} must be >= 1", e)
    _need(a.ppo_epochs >= 1, f"actor.ppo_epochs={a.ppo_epochs} must be >= 1", e)
    if W >= 1:
        _need(B % W == 0, f"a batch of data.train_batch_size x rollout.n = {d.train_batch_size} x {r.n} = {B} "
              f"samples does not divide over resources.trainer_workers={W}; change one of them", e)
        mini = a.mini_batch_size or B
        _need(a.mini_batch_size >= 0 and B % mini == 0,
              f"actor.mini_batch_size={a.mini_batch_size} must divide the batch of {B} samples "
              f"(data.train_batch_size x rollout.n), or be 0 for one mini-batch", e)
        _need(mini % W == 0, f"actor.mini_batch_size={mini} must be a multiple of resources.trainer_workers={W}", e)

    res = cfg.resources
    for key, v in (("resources.cpus_per_trainer_worker", res.cpus_per_trainer_worker), ("rollout.cpus_per_replica", r.cpus_per_replica)):
        _need(v >= 1, f"{key}={v} must be >= 1", e)
    if res.ray_address is None:
        cpus = os.cpu_count() if cpu_count is None else cpu_count
        colocated = cfg.pipeline.colocate and k == 0
        need = W * res.cpus_per_trainer_worker + (0 if colocated else r.replicas * r.cpus_per_replica)
        _need(need <= cpus, f"the run needs {need} CPU cores (resources.trainer_workers x "
              f"resources.cpus_per_trainer_worker + rollout.replicas x rollout.cpus_per_replica) but this "
              f"machine has {cpus}; lower those keys, or set pipeline.max_staleness=0 pipeline.colocate=true "
              f"to share cores, or give resources.ray_address of a larger Ray cluster", e)
        gpus_needed = W * res.gpus_per_trainer_worker + (0 if colocated else r.replicas * r.gpus_per_replica)
        gpus = available_gpus() if gpu_count is None else gpu_count
        _need(gpus_needed <= gpus, f"the run needs {gpus_needed} GPUs (resources.gpus_per_trainer_worker, "
              f"rollout.gpus_per_replica) but {gpus} are visible; set them to 0 to train on CPU", e)
    if cfg.trainer.device == "cuda":
        _need(res.gpus_per_trainer_worker >= 1, "trainer.device=cuda needs resources.gpus_per_trainer_worker >= 1", e)

    if cfg.reward.custom_path:
        _need(Path(cfg.reward.custom_path).is_file(),
              f"reward.custom_path={cfg.reward.custom_path!r} does not exist; give the path of a Python file "
              f"defining {cfg.reward.custom_name}(data_source, solution_str, ground_truth, extra_info=None)", e)
    for f in [*d.train_files, *d.val_files]:
        _need(Path(f).is_file(), f"data file {f!r} (data.train_files / data.val_files) does not exist", e)
    try:
        check_model_path(cfg.model.path)
    except ModelError as err:
        e.append(str(err))
    if e:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(e))
