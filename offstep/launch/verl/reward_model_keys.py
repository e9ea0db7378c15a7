"""verl's ``reward_model.*`` keys as offstep's ``reward.model``: ``reward_model.enable=True``
with ``reward_model.model.path`` is a discriminative reward model (verl's reward model is a
sequence classifier whose score replaces the rule's: ``weight=1``, ``rule_weight=0``, offstep's
defaults), scored on the rollout replicas. Its other keys apply only then: a verl config file
that carries ``reward_model.model.path`` with ``enable=False`` (verl's own defaults do) gets no
reward model."""

from __future__ import annotations

from offstep.config.schema import Config
from offstep.launch.verl.convert import fail, whole
from offstep.launch.verl.translate import Translation

ENABLE, PATH = "reward_model.enable", "reward_model.model.path"
BATCH_KEYS = ("reward_model.micro_batch_size_per_gpu", "reward_model.micro_batch_size")


def _flag(key: str, v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("true", "false"):
        return str(v).lower() == "true"
    raise fail(key, v, "expected True or False")


def reward_model(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    if not _flag(ENABLE, v.get(ENABLE, False)):
        return [f"{k}: no effect (reward_model.enable is not True)" for k in (PATH, *BATCH_KEYS) if k in v]
    if not v.get(PATH):
        raise fail(
            ENABLE,
            v[ENABLE],
            f"needs {PATH}, the reward model's folder (a sequence-classification model "
            f"saved with save_pretrained; docs/reward-models.md)",
        )
    m = cfg.reward.model
    m.kind, m.path = "discriminative", str(v[PATH])
    notes = [
        f"{ENABLE}=True {PATH}={m.path} -> reward.model.kind=discriminative reward.model.path={m.path}: scored on "
        f"the rollout replicas, with the reward model's own chat template (docs/reward-models.md)"
    ]
    for key in BATCH_KEYS:
        if v.get(key) is not None:
            m.batch_size = whole(key, v[key])
            notes.append(f"{key}={v[key]} -> reward.model.batch_size={m.batch_size} (per replica)")
    if "reward_model.model.trust_remote_code" in v:
        m.trust_remote_code = _flag("reward_model.model.trust_remote_code", v["reward_model.model.trust_remote_code"])
    if v.get("reward_model.max_length") is not None:
        m.max_length = whole("reward_model.max_length", v["reward_model.max_length"])
    return notes
