"""verl keys derived after composition that the DAPO recipe and rollout correction bring:
DAPO's group filter (``algorithm.filter_groups.*`` with ``data.gen_batch_size``) as offstep's
dynamic sampling, and ``rollout_is_threshold`` (null: no importance weights, as in verl).

verl's DAPO trainer generates rounds of ``gen_batch_size`` prompts and keeps the groups whose
``metric`` is not equal across the group until ``train_batch_size`` are kept (at most
``max_num_gen_batches`` rounds, 0 unlimited, then it stops with an error); offstep's rounds have
``data.train_batch_size`` prompts, so the rounds are counted to the same number of prompts, and
a batch the rounds cannot fill is topped up with equal-reward groups (advantage 0), which the note
says."""

from __future__ import annotations

import math

from offstep.config.schema import Config
from offstep.errors import VerlKeyError
from offstep.launch.verl.convert import DOC, fail, whole
from offstep.launch.verl.translate import Translation

FG = "algorithm.filter_groups."
GEN = "data.gen_batch_size"


def _metric(cfg: Config, metric: str) -> str:
    """Why verl's filter metric is offstep's (the scorer's score, before the overlong penalty)."""
    a = cfg.algorithm
    if metric in ("acc", "score"):
        return f"{metric}: offstep filters on the score (verl's acc is the score when the scorer returns a number)"
    if metric == "seq_reward" and not a.overlong_penalty:
        return "seq_reward: the score (no overlong penalty is added)"
    if metric == "seq_final_reward" and not a.overlong_penalty and not a.use_kl_in_reward:
        return "seq_final_reward: the score (no overlong penalty or KL in the reward)"
    raise fail(
        FG + "metric",
        metric,
        "offstep's dynamic sampling filters on the scorer's score (verl's acc or score); "
        "seq_reward and seq_final_reward differ from it with the overlong penalty or the KL in the reward on",
    )


def dapo_recipe(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    batch = cfg.data.train_batch_size
    if not v.get(FG + "enable"):
        notes = [
            f"{FG}{k}: accepted, no effect (filter_groups.enable is false)"
            for k in ("metric", "max_num_gen_batches")
            if FG + k in v
        ]
        if GEN in v and v[GEN] not in (None, batch, 1):
            raise VerlKeyError(
                f"verl key {GEN}={v[GEN]} is refused: without algorithm.filter_groups.enable=true offstep "
                f"generates and trains on data.train_batch_size={batch} prompts a step. Fix: set "
                f"data.train_batch_size={v[GEN]} and drop {GEN}, or enable filter_groups ({DOC})"
            )
        if GEN in v:
            notes.append(
                f"{GEN}={v[GEN]}: accepted, no effect (without filter_groups every generated prompt is trained on)"
            )
        return notes
    a = cfg.algorithm
    a.dynamic_sampling = True
    notes = [
        f"{FG}enable=true -> algorithm.dynamic_sampling=true (groups with equal scores are dropped and more "
        f"prompts generated; a batch the rounds cannot fill is topped up with equal-score groups, where verl stops "
        f"with an error)"
    ]
    notes.append(f"{FG}metric=" + _metric(cfg, v.get(FG + "metric") or "acc"))
    gen = whole(GEN, v[GEN]) if v.get(GEN) is not None else batch
    rounds = whole(FG + "max_num_gen_batches", v.get(FG + "max_num_gen_batches", 0))
    if rounds > 0:
        a.dynamic_sampling_max_attempts = max(1, math.ceil(rounds * gen / batch))
        notes.append(
            f"{FG}max_num_gen_batches={rounds} x {GEN}={gen} prompts -> algorithm.dynamic_sampling_max_attempts="
            f"{a.dynamic_sampling_max_attempts} rounds of data.train_batch_size={batch}"
        )
    else:
        notes.append(
            f"{FG}max_num_gen_batches=0 (verl: unlimited) -> algorithm.dynamic_sampling_max_attempts="
            f"{a.dynamic_sampling_max_attempts} rounds of data.train_batch_size={batch} (offstep's bound)"
        )
    return notes


def rollout_is_threshold(cfg: Config, t: Translation) -> list[str]:
    key = "algorithm.rollout_correction.rollout_is_threshold"
    if key not in t.verl:
        return []
    value = t.verl[key]
    if value is None:
        cfg.algorithm.tis = False
        return [f"{key}=null -> algorithm.tis=false (no importance weights, as in verl)"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(key, value, "expected a number (the cap of the importance weights) or null")
    cfg.algorithm.tis_cap = float(value)
    return []
