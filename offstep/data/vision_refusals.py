"""What a run with image prompts cannot do yet (docs/multimodal.md), as messages naming the key and
the fix. ``offstep.launch.validate`` asks before anything starts when the config names the ``tiny_vl``
alias, a vision-language model folder (its config.json's model_type) or the ``shapes`` task;
``offstep.pipeline.inputs`` asks again once the rows are read and have images. Imports nothing heavy."""

from __future__ import annotations

import os

from offstep.config.schema import Config
from offstep.models.vl_types import is_vision_language

TINY_VL = "tiny_vl"
IMAGE_TASKS = ("shapes",)


def images_expected(cfg: Config) -> bool:
    """The config alone says the prompts have images: the ``tiny_vl`` alias, a vision-language model
    folder, or an image task."""
    path = str(cfg.model.path).strip()
    return (
        path.lower() == TINY_VL
        or is_vision_language(os.path.expanduser(path))
        or (not cfg.data.train_files and cfg.data.task in IMAGE_TASKS)
    )


def vision_problems(cfg: Config) -> list[str]:
    """What the config asks that image prompts do not support yet."""
    why = "with image prompts (a vision-language model, docs/multimodal.md)"
    e: list[str] = []
    if cfg.rollout.engine != "builtin":
        e.append(
            f"rollout.engine={cfg.rollout.engine} {why}: only the built-in engine generates from images so far "
            "(vLLM's Qwen2-VL processor needs torchvision). Fix: rollout.engine=builtin"
        )
    if cfg.distill.enabled:
        e.append(f"distillation (distill.teacher) {why}: the teacher does not see the images yet. Fix: drop it")
    if cfg.algorithm.adv_estimator in ("gae", "remax"):
        e.append(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} {why}: its critic or greedy baseline does not "
            "take images yet. Fix: grpo, rloo or reinforce_plus_plus"
        )
    if cfg.env.kind:
        e.append(f"env.kind={cfg.env.kind} {why} is not supported. Fix: unset env.kind")
    return e
