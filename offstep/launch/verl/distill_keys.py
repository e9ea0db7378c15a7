"""verl's ``distillation.*`` keys as offstep's ``distill``: ``distillation.enabled=True`` with
``distillation.teacher_model.model_path`` is a teacher (on the rollout replicas, or with
``teacher_model.enable_resource_pool=True`` in a pool of ``distillation.num_workers`` workers).
verl's loss modes map where offstep has the same signal: ``k1`` by the policy gradient (verl's
``use_policy_gradient=True``) is ``loss_mode=k1``; ``forward_kl_topk`` as a supervised loss
(``use_policy_gradient=False``) is offstep's top-k term (renormalised over the top-k ids:
docs/distillation.md). Other modes and pairings are refused, naming what offstep has. The other
keys apply only when ``enabled`` is True."""

from __future__ import annotations

from offstep.config.schema import Config
from offstep.launch.verl.convert import fail, whole
from offstep.launch.verl.translate import Translation

ENABLED, PATH = "distillation.enabled", "distillation.teacher_model.model_path"
POOL, WORKERS = "distillation.teacher_model.enable_resource_pool", "distillation.num_workers"
LOSS = "distillation.distillation_loss."
KEYS = (
    PATH,
    POOL,
    WORKERS,
    *(
        LOSS + k
        for k in (
            "loss_mode",
            "topk",
            "use_task_rewards",
            "distillation_loss_coef",
            "log_prob_min_clamp",
            "use_policy_gradient",
            "loss_max_clamp",
        )
    ),
)
# verl's mode and use_policy_gradient -> offstep's loss_mode
MODES = {("k1", True): "k1", ("forward_kl_topk", False): "forward_kl_topk"}


def _flag(key: str, v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("true", "false"):
        return str(v).lower() == "true"
    raise fail(key, v, "expected True or False")


def _number(key: str, v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise fail(key, v, "expected a number") from None


def distillation(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    if not _flag(ENABLED, v.get(ENABLED, False)):
        return [f"{k}: no effect (distillation.enabled is not True)" for k in KEYS if k in v]
    if not v.get(PATH):
        raise fail(
            ENABLED,
            v[ENABLED],
            f"needs {PATH}, the teacher's folder (a causal LM with the policy's tokenizer; docs/distillation.md)",
        )
    d = cfg.distill
    d.teacher.path = str(v[PATH])
    notes = [f"{ENABLED}=True {PATH}={d.teacher.path} -> distill.teacher.path={d.teacher.path}"]
    if _flag(POOL, v.get(POOL, False)):
        d.teacher.placement = "pool"
        if v.get(WORKERS) is not None:
            cfg.resources.teacher_workers = whole(WORKERS, v[WORKERS])
        notes.append(
            f"{POOL}=True -> distill.teacher.placement=pool, resources.teacher_workers={cfg.resources.teacher_workers}"
        )
    mode = str(v.get(LOSS + "loss_mode", "k3"))
    gradient = _flag(LOSS + "use_policy_gradient", v.get(LOSS + "use_policy_gradient", True))
    if (mode, gradient) not in MODES:
        raise fail(
            LOSS + "loss_mode",
            mode,
            f"with use_policy_gradient={gradient} has no offstep counterpart; offstep "
            f"has k1 by the policy gradient (use_policy_gradient=True) and forward_kl_topk as a supervised "
            f"loss (use_policy_gradient=False): distill.loss_mode=k1 | forward_kl_topk (docs/distillation.md)",
        )
    d.loss_mode = MODES[mode, gradient]
    notes.append(f"{LOSS}loss_mode={mode} use_policy_gradient={gradient} -> distill.loss_mode={d.loss_mode}")
    if v.get(LOSS + "topk") is not None:
        d.topk = whole(LOSS + "topk", v[LOSS + "topk"])
    if LOSS + "use_task_rewards" in v:
        d.use_task_rewards = _flag(LOSS + "use_task_rewards", v[LOSS + "use_task_rewards"])
    if v.get(LOSS + "distillation_loss_coef") is not None:
        d.coef = _number(LOSS + "distillation_loss_coef", v[LOSS + "distillation_loss_coef"])
    if v.get(LOSS + "log_prob_min_clamp") is not None:
        d.log_prob_min_clamp = _number(LOSS + "log_prob_min_clamp", v[LOSS + "log_prob_min_clamp"])
    if v.get(LOSS + "loss_max_clamp") is not None:
        notes.append(
            f"{LOSS}loss_max_clamp: no effect (offstep bounds the k1 signal by log_prob_min_clamp; the top-k "
            f"term is a KL between renormalised distributions)"
        )
    return notes
