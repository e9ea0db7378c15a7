"""verl's scripts, round 2 (docs/from-verl.md): GRPO with rollout.n=1 scored as verl scores a group
of one response, and an empty value (an unset shell variable) read as verl reads it."""

from __future__ import annotations

import pytest
import torch

from offstep.algos.advantages import grpo_outcome_advantage, opo_advantage, rloo_advantage
from offstep.launch.loader import ConfigError, load_config
from offstep.launch.validate import problems


def load(args):
    notes: list[str] = []
    return load_config(list(args), notes), notes


# ---------------------------------------------------------------- rollout.n=1 with GRPO


def test_one_response_groups_take_verls_score():
    # verl's compute_grpo_outcome_advantage: a group of one has mean 0 and std 1, so (r - 0) / (1 + 1e-6)
    scores, ids, mask = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 1, 2]), torch.ones(3, 2)
    adv, _ = grpo_outcome_advantage(scores, ids, mask, alone="score")
    torch.testing.assert_close(adv[:, 0], scores / (1 + 1e-6))
    adv, _ = grpo_outcome_advantage(scores, ids, mask, norm_by_std=False, alone="score")
    torch.testing.assert_close(adv[:, 0], scores)  # norm_adv_by_std_in_grpo=False: r - 0
    # offstep's own convention: no other response to compare with, advantage 0
    assert float(grpo_outcome_advantage(scores, ids, mask)[0].abs().sum()) == 0
    # RLOO and OPO keep the raw score in verl; groups of two are unchanged by the option
    torch.testing.assert_close(rloo_advantage(scores, ids, mask, alone="score")[0][:, 0], scores)
    torch.testing.assert_close(opo_advantage(scores, ids, mask, alone="score")[0][:, 0], scores)
    pair = torch.tensor([0, 0, 1])
    torch.testing.assert_close(
        grpo_outcome_advantage(scores, pair, mask, alone="score")[0][:2],
        grpo_outcome_advantage(scores, pair, mask)[0][:2],
    )


def test_verl_grpo_with_n_1_runs_with_verls_advantage_and_a_note():
    # verl's LoRA script for 0.5B on one GPU: GRPO, rollout.n=1
    cfg, notes = load(
        [
            "preset=tiny",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "data.train_batch_size=8",
        ]
    )
    assert (cfg.rollout.n, cfg.algorithm.one_response_groups) == (1, "score")
    assert any(n.startswith("algorithm.one_response_groups=zero -> score") for n in notes), notes
    assert problems(cfg) == []
    # offstep's own command line keeps its convention and its check
    assert any(
        "needs rollout.n >= 2" in p and "one_response_groups=score" in p
        for p in problems(load_config(["preset=tiny", "rollout.n=1"]))
    )
    cfg = load_config(["preset=tiny", "rollout.n=1", "algorithm.one_response_groups=score"])
    assert problems(cfg) == []
    # the offstep key given beside verl's keys wins, and is checked
    cfg = load_config(
        [
            "preset=tiny",
            "actor_rollout_ref.rollout.n=1",
            "algorithm.adv_estimator=grpo",
            "algorithm.one_response_groups=zero",
        ]
    )
    assert cfg.algorithm.one_response_groups == "zero" and any("needs rollout.n >= 2" in p for p in problems(cfg))


# ---------------------------------------------------------------- empty values


def test_empty_bool_is_false_as_verl_reads_it():
    # use_kl_loss=${use_kl_loss} with the variable unset: verl's `if config.use_kl_loss:` is false
    cfg, notes = load(["preset=tiny", "actor_rollout_ref.actor.use_kl_loss=", "algorithm.use_kl_in_reward="])
    assert (cfg.algorithm.use_kl_loss, cfg.algorithm.use_kl_in_reward) == (False, False)
    assert any(
        "use_kl_loss='' (empty, as an unset shell variable gives) -> algorithm.use_kl_loss=false" in n for n in notes
    ), notes
    # a number stays refused: verl would fail on it too, later
    with pytest.raises(ConfigError):
        load_config(["preset=tiny", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="])
