"""verl's fully-async command line (``python3 -m verl.experimental.fully_async_policy.fully_async_main``)
as ``pipeline.mode=fully_async``: its ``async_training.*`` keys, verl's
``rollout.total_rollout_steps`` / ``total_epochs`` / ``test_freq``, or its config
(``--config-name=fully_async_ppo_trainer``) make a command line one (``async_signals``), and
``fully_async_mode`` derives the offstep keys."""

from __future__ import annotations

import math
from typing import Any

from offstep.config.schema import Config
from offstep.errors import OffstepError, VerlKeyError
from offstep.launch.verl.convert import DOC, at_least_one, boolean, fail, never, training_rows, whole
from offstep.launch.verl.translate import Translation, async_signals

# verl's fully-async defaults (fully_async_ppo_trainer.yaml, ppo_trainer.yaml) for the keys that
# a derivation needs beside the one given
VERL_ASYNC_DEFAULTS = {
    "async_training.trigger_parameter_sync_step": 4,
    "async_training.require_batches": 1,
    "rollout.total_rollout_steps": 100,
    "trainer.total_epochs": 30,
    "rollout.total_epochs": 10,
    "async_training.use_rollout_log_probs": True,
    "async_training.compute_prox_log_prob": False,
}


def _direct(t: Translation) -> dict[str, str]:
    """The offstep keys given on the command line themselves (not as a verl key), with their text."""
    out = {}
    for line in t.overrides:
        key, _, value = line.partition("=")
        key = key.lstrip("+~")
        if key not in t.origin:
            out[key] = value.strip("'\"")
    return out


def fully_async_mode(cfg: Config, t: Translation) -> list[str]:
    """verl's fully-async command line as ``pipeline.mode=fully_async``. One offstep step is what
    verl's trainer does between two weight syncs (trigger_parameter_sync_step updates of
    require_batches x ppo_mini_batch_size prompts), so verl's weight versions are offstep's steps."""
    by = async_signals(t)
    if not by:
        return []
    v, notes, direct = t.verl, [], _direct(t)

    def d(key: str) -> Any:  # a verl key's value, or verl's default
        return v.get(key, VERL_ASYNC_DEFAULTS.get(key))

    given_mode = direct.get("pipeline.mode", "fully_async")
    if given_mode != "fully_async":
        raise VerlKeyError(
            f"pipeline.mode={given_mode} with verl's fully-async keys ({', '.join(by[:3])}): they run "
            f"pipeline.mode=fully_async. Fix: drop pipeline.mode, or drop verl's fully-async keys for "
            f"pipeline.mode=batch ({DOC})"
        )
    cfg.pipeline.mode = "fully_async"
    notes.append(
        f"{', '.join(by[:3])}{', ...' if len(by) > 3 else ''}: verl's fully-async trainer -> pipeline.mode=fully_async"
    )
    # a step: the trainer updates between two weight syncs
    trig_key, req_key = "async_training.trigger_parameter_sync_step", "async_training.require_batches"
    trig, req = at_least_one(trig_key, d(trig_key)), at_least_one(req_key, d(req_key))
    mini_key = "actor_rollout_ref.actor.ppo_mini_batch_size"
    mini = whole(mini_key, v[mini_key]) if mini_key in v else max(1, cfg.actor.mini_batch_size // cfg.rollout.n)
    batch = trig * req * mini
    if "data.train_batch_size" in t.given and cfg.data.train_batch_size not in (0, batch):
        raise fail(
            "data.train_batch_size",
            cfg.data.train_batch_size,
            f"verl's fully-async mode takes 0 (it refuses others): a step there is trigger_parameter_sync_step "
            f"x require_batches x ppo_mini_batch_size = {trig} x {req} x {mini} = {batch} prompts, which "
            f"becomes data.train_batch_size. Fix: drop it or set 0",
        )
    cfg.data.train_batch_size = batch
    notes.append(
        f"{trig_key}={trig} x {req_key}={req} x ppo_mini_batch_size={mini} -> data.train_batch_size={batch} "
        f"prompts (one step per weight sync; actor.mini_batch_size={cfg.actor.mini_batch_size} sequences, "
        f"{batch * cfg.rollout.n // max(1, cfg.actor.mini_batch_size)} updates a step)"
    )
    if trig > 1 and cfg.actor.ppo_epochs > 1:
        notes.append(
            f"actor.ppo_epochs={cfg.actor.ppo_epochs}: verl runs the epochs over each of its {trig} local "
            f"batches in turn, offstep over the step's whole batch (the same updates when ppo_epochs=1)"
        )
    # staleness
    key = "async_training.staleness_threshold"
    stale = None
    if key in v:
        stale = v[key]
        if isinstance(stale, bool) or not isinstance(stale, (int, float)) or not 0 <= stale < math.inf:
            raise fail(key, stale, "expected a number >= 0 (a fraction of a step's prompts)")
        cfg.pipeline.max_staleness = math.ceil(stale)
        notes.append(
            f"{key}={stale} -> pipeline.max_staleness={cfg.pipeline.max_staleness} (ceil: verl generates at "
            f"most {stale} x {batch} prompts ahead of a step, so a sample ends at most "
            f"{cfg.pipeline.max_staleness} weight versions behind; offstep bounds its oldest token's version, "
            f"and lets up to whole steps run ahead within that bound)"
        )
    # partial rollouts
    key = "async_training.partial_rollout"
    if key in v:
        on = boolean(key, v[key])
        cfg.rollout.partial = "recompute" if on else "off"
        why = (
            "verl aborts in-flight requests at a weight load, frees the KV cache and resubmits prompt + tokens so "
            "far, prefilled again under the new weights; rollout.partial=keep would keep the old KV instead"
            if on
            else "verl lets in-flight samples finish under the old weights before the load"
        )
        notes.append(f"{key}={on} -> rollout.partial={cfg.rollout.partial} ({why})")
        if on and stale == 0:
            notes.append(
                f"{key}: no sample crosses a load at staleness_threshold=0 (pipeline.max_staleness=0), as in verl"
            )
    # PPO's old log-probs
    use, prox = "async_training.use_rollout_log_probs", "async_training.compute_prox_log_prob"
    if use in v or prox in v:
        from_rollout, recompute = boolean(use, d(use)), boolean(prox, d(prox))
        mode = "bypass" if from_rollout and not recompute else "decoupled"
        bypass = "algorithm.rollout_correction.bypass_mode"
        if bypass in v and bool(v[bypass]) != (mode == "bypass"):
            raise fail(
                bypass,
                v[bypass],
                f"{use}={from_rollout} with {prox}={recompute} is algorithm.correction_mode={mode}. Fix: drop {bypass}",
            )
        cfg.algorithm.correction_mode = mode
        why = {
            (True, False): "PPO's old log-probs are the rollout's, from the version that sampled each token",
            (True, True): "the trainer's log-probs with the weights the step starts from, as verl's proximal "
            "policy; importance weights and rejection as algorithm.rollout_correction.* say",
        }.get(
            (from_rollout, recompute),
            "the trainer's log-probs, computed once per step (verl: before each "
            "of its local updates, so they match only when trigger_parameter_sync_step=1)",
        )
        notes.append(f"{use}={from_rollout}, {prox}={recompute} -> algorithm.correction_mode={mode} ({why})")
    # the run's length: verl's weight versions
    total, te, re_ = "rollout.total_rollout_steps", "trainer.total_epochs", "rollout.total_epochs"
    if any(k in v for k in (total, te, re_)):
        prompts = d(total)
        prompts = None if prompts is None else whole(total, prompts)
        epochs = min(whole(te, d(te)), whole(re_, d(re_)))
        try:
            rows = training_rows(cfg)
        except (OffstepError, ValueError, OSError) as err:
            raise VerlKeyError(
                f"verl key {total} is capped at rows x epochs of data.train_files, whose rows could "
                f"not be counted: {err}"
            ) from None
        count = rows * epochs if prompts is None else min(prompts, rows * epochs)
        if count // batch < 1:
            raise fail(
                total,
                prompts,
                f"{count} prompts (capped at {rows} rows x {epochs} epochs) do not fill one "
                f"step of {batch}; raise rollout.total_rollout_steps or lower the step's keys",
            )
        cfg.trainer.total_steps = count // batch
        notes.append(
            f"{total}={prompts}{'' if total in v else ' (verl default)'}, capped at {rows} rows x {epochs} "
            f"epochs -> trainer.total_steps={cfg.trainer.total_steps} (floor({count} / {batch}): verl's weight "
            f"versions; rows counted before data.filter_overlong_prompts)"
        )
    if "trainer.total_training_steps" in t.given:
        notes.append(
            "trainer.total_training_steps: accepted, no effect (verl's fully-async trainer counts "
            "rollout.total_rollout_steps)"
        )
    # validation
    key = "rollout.test_freq"
    if key in v:
        cfg.trainer.val_freq = never(key, v[key])
        notes.append(f"{key}={v[key]} -> trainer.val_freq={cfg.trainer.val_freq} (every N weight versions = N steps)")
        if "trainer.test_freq" in t.given:
            notes.append(
                "trainer.test_freq: accepted, no effect (verl's fully-async trainer validates every rollout.test_freq versions)"
            )
    elif "trainer.test_freq" in t.given:
        notes.append(
            f"trainer.test_freq -> trainer.val_freq={cfg.trainer.val_freq}: verl's fully-async trainer reads "
            f"rollout.test_freq instead (its default 1: every version); add rollout.test_freq to say which"
        )
    return notes
