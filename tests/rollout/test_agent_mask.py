"""The loss mask of multi-turn samples, by hand: a sample's tool-turn tokens are in the sequence
the trainer reads (attention, positions, micro-batch widths) but out of every loss term: the
policy loss, the KL, the entropy, the per-token corrections, the advantages and the length
normalisations. One sample below, with the arithmetic in comments:

    prompt [5, 6]; response [10, 11, 90, 91, 12], loss_mask [1, 1, 0, 0, 1]
        (model turn 10 11 | tool turn 90 91 | model turn 12)
    a single-turn sample: prompt [7], response [20, 21] (loss_mask None)

Per-token quantities at the tool positions are set to garbage (NaN, 1e30): none may leak.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from offstep.algos.advantages import grpo_outcome_advantage, opo_advantage, outcome_token_rewards
from offstep.algos.common import aggregate_loss, masked_mean
from offstep.algos.correction import mismatch_kl_terms, truncated_importance_weights
from offstep.algos.losses import kl_penalty
from offstep.algos.policy_losses import policy_loss
from offstep.batch import AgentStats, Sample, collate, micro_batches, sample_lengths

NAN, HUGE = float("nan"), 1e30


def _samples():
    multi = Sample(
        uid=0,
        prompt_ids=[5, 6],
        response_ids=[10, 11, 90, 91, 12],
        rollout_logprobs=[-1.0, -2.0, 0.0, 0.0, -3.0],
        finish_reason="stop",
        score=1.0,
        version=0,
        loss_mask=[1, 1, 0, 0, 1],
        agent=AgentStats(turns=2, tool_calls=1),
    )
    single = Sample(
        uid=0,
        prompt_ids=[7],
        response_ids=[20, 21],
        rollout_logprobs=[-0.5, -0.25],
        finish_reason="stop",
        score=0.0,
        version=0,
    )
    return [multi, single]


def test_collate_masks_tool_tokens_out_of_the_loss_but_not_out_of_attention():
    b = collate(_samples(), pad_id=0)
    # P = 2, R = 5: row 0 [5 6 | 10 11 90 91 12], row 1 [0 7 | 20 21 0 0 0]
    assert b.input_ids.tolist() == [[5, 6, 10, 11, 90, 91, 12], [0, 7, 20, 21, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    assert b.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6]  # the tool tokens keep their positions
    assert b.response_mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert b.rollout_logprobs[0].tolist() == [-1.0, -2.0, 0.0, 0.0, -3.0]
    # Micro-batching measures the whole sequence: row 0's response is 5 tokens wide, not 3.
    assert sample_lengths(b) == ([2, 1], [5, 2])
    ((_, mb),) = micro_batches(b, 2, token_budget=64)
    assert mb.response_mask.shape[1] == 5 and mb.input_ids.tolist()[0] == [5, 6, 10, 11, 90, 91, 12]


def test_single_turn_samples_collate_bit_for_bit_as_before():
    """loss_mask=None and loss_mask all ones give the identical batch (rows without agent columns
    never carry a mask)."""
    plain = _samples()[1]
    ones = dataclasses.replace(plain, loss_mask=[1, 1])
    a, b = collate([plain], 0), collate([ones], 0)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f.name


def _mask():
    return collate(_samples(), 0).response_mask


def _with_garbage(model_values: list[list[float]]) -> torch.Tensor:
    """[2, 5] with the model tokens' values given and garbage on tool tokens and padding."""
    row0 = [model_values[0][0], model_values[0][1], NAN, HUGE, model_values[0][2]]
    row1 = [model_values[1][0], model_values[1][1], HUGE, NAN, HUGE]
    return torch.tensor([row0, row1])


def test_loss_aggregations_count_model_tokens_only():
    mask = _mask()
    loss = _with_garbage([[1.0, 2.0, 3.0], [4.0, 5.0]])
    # token-mean: (1 + 2 + 3 + 4 + 5) / 5 model tokens = 3
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-mean: row 0 (1 + 2 + 3) / 3 = 2, row 1 (4 + 5) / 2 = 4.5 -> 3.25
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.25)
    # seq-mean-token-sum: (6 + 9) / 2 = 7.5; Dr. GRPO's norm with horizon 10: (0.6 + 0.9) / 2 = 0.75
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(7.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx(0.75)
    # The trainer's token-mean normaliser is the model tokens of the mini-batch: 5, not 7.
    assert float(mask.sum()) == 5.0


def test_policy_loss_kl_and_entropy_ignore_tool_tokens():
    mask = _mask()
    logp = _with_garbage([[-1.0, -2.0, -3.0], [-0.5, -0.25]])
    old = _with_garbage([[-1.0, -2.0, -3.0], [-0.5, -0.25]])
    adv = _with_garbage([[1.0, 1.0, 1.0], [-1.0, -1.0]])
    per_token, m = policy_loss("ppo", logp, old, adv, mask)
    # ratio 1 everywhere: loss_t = -A_t -> token-mean (-3 + 2) / 5 = -0.2; nothing from the tool tokens
    assert aggregate_loss(per_token, mask, "token-mean").item() == pytest.approx(-0.2)
    assert m["clipfrac"].item() == 0.0 and m["ppo_kl"].item() == 0.0
    ref = _with_garbage([[-1.0, -2.5, -3.0], [-0.5, -0.25]])
    kl = kl_penalty(logp, ref, kind="k1")
    # k1 = logp - ref: 0, 0.5, 0 on row 0, 0, 0 on row 1 -> mean over 5 model tokens = 0.1
    assert masked_mean(kl, mask).item() == pytest.approx(0.1)
    assert aggregate_loss(kl, mask, "token-mean").item() == pytest.approx(0.1)
    entropy = _with_garbage([[1.0, 2.0, 3.0], [0.5, 0.5]])
    assert masked_mean(entropy, mask).item() == pytest.approx(7.0 / 5)  # (1 + 2 + 3 + 0.5 + 0.5) / 5


def test_importance_weights_and_mismatch_kl_ignore_tool_tokens():
    """The tool tokens' rollout log-probs are 0 placeholders: were they counted, pi_old / pi_rollout
    there would be exp(old - 0), far from 1."""
    mask = _mask()
    rollout = collate(_samples(), 0).rollout_logprobs  # 0.0 on the tool tokens
    old = torch.tensor([[-1.1, -2.0, -7.0, -9.0, -2.9], [-0.5, -0.25, 0.0, 0.0, 0.0]])
    w, m = truncated_importance_weights(old, rollout, mask, cap=2.0, level="token")
    # token level: exp(-0.1), exp(0), -, -, exp(0.1); row 1: 1, 1
    want = torch.tensor(
        [[torch.exp(torch.tensor(-0.1)), 1.0, 0.0, 0.0, torch.exp(torch.tensor(0.1))], [1.0, 1.0, 0.0, 0.0, 0.0]]
    )
    assert torch.allclose(w, want, atol=1e-6)
    ws, _ = truncated_importance_weights(old, rollout, mask, cap=2.0, level="sequence")
    # sequence level, row 0: exp(-0.1 + 0 + 0.1) = 1 on its model tokens only
    assert torch.allclose(ws[0], torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0]), atol=1e-6)
    k1, k3 = mismatch_kl_terms(old, rollout, mask)
    # k1 = rollout - old per model token: 0.1, 0, -0.1, 0, 0 -> mean 0
    assert masked_mean(k1, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_advantages_and_outcome_reward_skip_tool_tokens():
    mask = _mask()
    scores, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    adv, _ = grpo_outcome_advantage(scores, groups, mask, norm_by_std=False)
    # group mean 0.5: +0.5 on row 0's model tokens, -0.5 on row 1's, 0 on tool tokens and padding
    assert adv.tolist() == [[0.5, 0.5, 0.0, 0.0, 0.5], [-0.5, -0.5, 0.0, 0.0, 0.0]]
    # The outcome reward sits on the last model token (here the sample's last token).
    assert outcome_token_rewards(scores, mask).tolist() == [[0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0]]
    # OPO's length weights count model tokens: baseline (3 * 1 + 2 * 0) / 5 = 0.6 -> A = 0.4, -0.6
    opo, _ = opo_advantage(scores, groups, mask)
    assert opo[0, 0].item() == pytest.approx(0.4) and opo[1, 0].item() == pytest.approx(-0.6)


def test_multi_turn_samples_survive_a_checkpoint_whole():
    """Samples of a batch generating at save time are stored in the trainer state (JSON) and come
    back with their mask and loop statistics."""
    from offstep.batch import GenTiming, Span
    from offstep.pipeline.dynamic_sampling import Generated
    from offstep.pipeline.trainer_state import TrainerState, decode_state, encode_state

    samples = _samples()
    gen = Generated(rounds=[[(samples, GenTiming(Span(0.0, 1.0, 0)))]], samples=samples, prompt_of={0: 3})
    text = encode_state(TrainerState(3, 3, 0.0, {"epoch": 0, "position": 4}, [(4, 0, [3], gen)], 0), "run")
    json.loads(text)  # plain JSON: no pickles
    state, _, _ = decode_state(text)
    back = state.in_flight[0][3].samples
    assert back[0] == samples[0] and back[1] == samples[1]
    assert isinstance(back[0].agent, AgentStats) and back[0].agent.turns == 2 and back[0].loss_mask == [1, 1, 0, 0, 1]
