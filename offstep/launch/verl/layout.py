"""verl's launch layout and defaults on a verl command line, after Hydra composes the config.

``colocated_layout``: verl's ``main_ppo`` (its hybrid engine) runs the actor and the rollout on the
same devices, taking turns, one policy version at a time. A command line with trainer devices only
(``trainer.n_gpus_per_node`` / ``trainer.nnodes``, no ``rollout.n_gpus_per_node`` /
``rollout.nnodes``, no fully-async key) becomes ``pipeline.colocate=true
pipeline.max_staleness=0``: one rollout replica per trainer worker, on its devices. verl's
one-step scripts (``verl.experimental.one_step_off_policy``) name the rollout pool and keep
their own (``offstep.launch.verl.derive``).

``verl_defaults``: where verl's default differs from the preset's, and the command line gives
neither the verl key nor the offstep key, the translation uses verl's value (``verl_values``: the
advantage estimator, the KL loss, ``rollout.n``, validation; ``verl_defaults``: the learning-rate
warm-up, the rollout dtype where the devices allow it) or prints one line naming the key.

``nodes_of``: the nodes a verl command line names (``offstep train --cfg --gpus N``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from offstep.config.schema import Config
from offstep.launch.verl.convert import whole
from offstep.launch.verl.translate import Translation, async_signals, is_offstep_key

TRAINER_POOL = ("trainer.n_gpus_per_node", "trainer.nnodes")
ROLLOUT_POOL = ("rollout.n_gpus_per_node", "rollout.nnodes")


def _direct(t: Translation) -> set[str]:
    """The offstep keys the command line gives itself (not as a verl key)."""
    keys = {line.partition("=")[0].lstrip("+~") for line in t.overrides}
    return {k for k in keys if k not in t.origin}


@lru_cache(maxsize=None)
def _verl_only(key: str) -> bool:
    return not is_offstep_key(key)


def is_verl_command(t: Translation) -> bool:
    """Whether the command line names a key only verl has (offstep's own keys that share verl's
    name, such as data.train_batch_size, do not make it one)."""
    return any(not k.startswith("--") and _verl_only(k) for k in t.given)


def is_main_ppo(t: Translation) -> bool:
    """verl's main_ppo layout: trainer devices given, no rollout pool, no fully-async key."""
    return (
        any(k in t.given for k in TRAINER_POOL) and not any(k in t.given for k in ROLLOUT_POOL) and not async_signals(t)
    )


def colocated_layout(cfg: Config, t: Translation) -> list[str]:
    """verl's hybrid engine as offstep's colocated synchronous training (``is_main_ppo``); never a
    rollout replica without a device where the trainer workers have GPUs."""
    if not is_main_ppo(t):
        return []
    direct, res, ro, p = _direct(t), cfg.resources, cfg.rollout, cfg.pipeline
    given = sorted(direct & {"pipeline.colocate", "pipeline.max_staleness", "pipeline.mode"})
    colocate = not given or (p.colocate and p.max_staleness == 0 and p.mode == "batch")
    notes = []
    if colocate:
        p.colocate, p.max_staleness = True, 0
        notes.append(
            "trainer.n_gpus_per_node without rollout.n_gpus_per_node: verl's main_ppo (hybrid engine, "
            "synchronous) -> pipeline.colocate=true pipeline.max_staleness=0 (the rollout takes turns with "
            "the trainer on its devices; add rollout.n_gpus_per_node for verl's one-step layout)"
        )
    else:
        notes.append(
            f"trainer.n_gpus_per_node without rollout.n_gpus_per_node is verl's colocated main_ppo, but "
            f"{', '.join(given)} given: offstep's separate rollout pool (drop {given[0]} for the colocated layout)"
        )
    if "rollout.replicas" not in direct and (colocate or ro.replicas < 1):
        ro.replicas = res.trainer_workers
        notes.append(f"-> rollout.replicas={ro.replicas} (one per trainer worker)")
    if "rollout.gpus_per_replica" not in direct and ro.gpus_per_replica == 0 and res.gpus_per_trainer_worker > 0:
        ro.gpus_per_replica = res.gpus_per_trainer_worker
        notes.append(
            f"-> rollout.gpus_per_replica={ro.gpus_per_replica} (a replica on a GPU node has a GPU"
            + (")" if colocate else "; the rollout pool is separate, so the run needs those GPUs too)")
        )
    return notes


def _rollout_on_gpu(cfg: Config) -> bool:
    colocated = cfg.pipeline.colocate and cfg.pipeline.max_staleness == 0
    return (cfg.resources.gpus_per_trainer_worker if colocated else cfg.rollout.gpus_per_replica) > 0


def _warmup(cfg: Config, t: Translation, direct: set[str]) -> list[str]:
    """verl's learning-rate warm-up: none by default, and ``lr_warmup_steps=-1`` means
    ``lr_warmup_steps_ratio`` (default 0.0) x the steps; the preset's warm-up does not apply."""
    notes = []
    for role, prefix in (("actor", "actor_rollout_ref.actor.optim"), ("critic", "critic.optim")):
        warm, ratio = f"{prefix}.lr_warmup_steps", f"{prefix}.lr_warmup_steps_ratio"
        v: dict[str, Any] = t.verl
        set_by_verl = (v.get(warm) is not None and whole(warm, v[warm]) >= 0) or float(v.get(ratio) or 0) > 0
        optim = getattr(cfg, role).optim
        if set_by_verl or f"{role}.optim.warmup_steps" in direct or optim.warmup_steps == 0:
            continue
        notes.append(
            f"{role}.optim.warmup_steps={optim.warmup_steps} (preset {cfg.preset}) -> 0: verl's default, "
            f"no warm-up (set {warm} to warm up)"
        )
        optim.warmup_steps = 0
    return notes


# offstep key, verl key, verl's default: where the preset's value differs, verl's is used
VERL_VALUES: tuple[tuple[str, str, Any], ...] = (
    ("algorithm.adv_estimator", "algorithm.adv_estimator", "gae"),
    ("algorithm.use_kl_loss", "actor_rollout_ref.actor.use_kl_loss", False),
    ("rollout.n", "actor_rollout_ref.rollout.n", 1),
    ("trainer.val_freq", "trainer.test_freq", -1),
)


def _get(cfg: Config, key: str) -> tuple[Any, str]:
    *path, name = key.split(".")
    node: Any = cfg
    for part in path:
        node = getattr(node, part)
    return node, name


def verl_values(cfg: Config, t: Translation) -> list[str]:
    """verl's own values for the keys of ``VERL_VALUES`` on a verl command line that gives neither
    verl's key nor offstep's: the preset's do not leak in (a PPO script without ``rollout.n`` samples
    one response per prompt, as in verl). Runs before the mini-batches, which count ``rollout.n``.
    In fully-async mode validation keeps its own schedule (``trainer.val_freq``)."""
    if not is_verl_command(t):
        return []
    direct, notes = _direct(t), []
    for ours, theirs, verl_value in VERL_VALUES:
        if theirs in t.given or ours in direct or ours in t.origin:
            continue
        node, name = _get(cfg, ours)
        value = getattr(node, name)
        if value == verl_value or (ours == "trainer.val_freq" and cfg.pipeline.mode == "fully_async"):
            continue
        setattr(node, name, verl_value)
        notes.append(
            f"{ours}={value} (preset {cfg.preset}) -> {verl_value}: verl's default for {theirs} "
            f"(set {theirs} to choose)"
        )
    return notes


def verl_defaults(cfg: Config, t: Translation) -> list[str]:
    """verl's defaults where the preset's differ and depend on the rest of the translation (the
    warm-up on the step count, the rollout dtype on the devices): verl's value, or one line naming
    the difference and the key (a verl command line only, keys given neither as verl's nor as offstep's)."""
    if not is_verl_command(t):
        return []
    direct = _direct(t)
    notes = _warmup(cfg, t, direct) + _one_response_groups(cfg, direct)
    key = "actor_rollout_ref.rollout.dtype"
    if key not in t.given and "rollout.dtype" not in direct and cfg.rollout.dtype != "bfloat16":
        if _rollout_on_gpu(cfg):
            notes.append(f"rollout.dtype={cfg.rollout.dtype} -> bfloat16: verl's default for {key} (bf16)")
            cfg.rollout.dtype = "bfloat16"
        else:
            notes.append(
                f"rollout.dtype={cfg.rollout.dtype}: verl generates in bf16 ({key}), which a CPU rollout "
                f"runs slower; set {key}=bf16 to match verl"
            )
    return notes


def _one_response_groups(cfg: Config, direct: set[str]) -> list[str]:
    """verl scores a group of one response with mean 0 and std 1 (the advantage is the score); a
    verl command line gets that, said where every group has one response (rollout.n=1)."""
    algo = cfg.algorithm
    if "algorithm.one_response_groups" in direct or algo.one_response_groups == "score":
        return []
    algo.one_response_groups = "score"
    if cfg.rollout.n != 1 or algo.adv_estimator not in ("grpo", "rloo", "opo"):
        return []
    return [
        f"algorithm.one_response_groups=zero -> score: with rollout.n=1 every group of "
        f"algorithm.adv_estimator={algo.adv_estimator} has one response, which verl scores with group mean 0 and "
        f"std 1, so the advantage is the score (offstep's own convention gives 0, no gradient; "
        f"docs/from-verl.md)"
    ]


def nodes_of(overrides: list[str]) -> int:
    """The nodes a verl command line names: trainer.nnodes, plus rollout.nnodes where the rollout
    pool is separate (verl's default 1 each); 1 without them."""
    given: dict[str, int] = {}
    for arg in overrides:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+")
        if sep and key in ("trainer.nnodes", "rollout.nnodes", "rollout.n_gpus_per_node"):
            try:
                given[key] = max(1, int(value.strip("'\"")))
            except ValueError:
                return 1  # the translation refuses it, with its message
    trainer = given.get("trainer.nnodes", 1)
    pool = "rollout.nnodes" in given or "rollout.n_gpus_per_node" in given
    return trainer + (given.get("rollout.nnodes", 1) if pool else 0)
