"""Token-budget micro-batches with padding trimmed (offstep/batch.py): the planner by hand, the
trim and its inverse, and exact invariance of log-probs and gradients against the padded
fixed-count path, through the real actor worker (in-process, one gloo rank)."""

from __future__ import annotations

import pytest
import torch

from offstep.batch import Sample, collate, micro_batches, plan_micro_batches, sample_lengths, scatter_rows, trim_padding
from offstep.config.schema import ActorConfig, AlgorithmConfig
from offstep.launch.loader import ConfigError, load_config
from offstep.launch.preflight import validate

# ---------------------------------------------------------------- the planner (pure)


def test_plan_hand_worked():
    # rows:        0  1  2  3  4  5
    prompt_lens = [4, 4, 5, 4, 5, 4]
    resp_lens = [10, 2, 20, 3, 1, 11]
    # totals 14, 6, 25, 7, 6, 15; longest first (ties by index): 2, 5, 0, 3, 1, 4.
    # budget 40:
    #   [2]      cost 1 x (5+20) = 25
    #   + 5      cost 2 x (5+20) = 50 > 40 -> new group [5]: 1 x (4+11) = 15
    #   + 0      cost 2 x (4+11) = 30 <= 40 -> [5, 0]
    #   + 3      cost 3 x (4+11) = 45 > 40  -> new group [3]: 1 x (4+3) = 7
    #   + 1      cost 2 x (4+3)  = 14       -> [3, 1]
    #   + 4      cost 3 x (5+3)  = 24       -> [3, 1, 4]  (the longest prompt comes from row 4)
    assert plan_micro_batches(prompt_lens, resp_lens, 40) == [[2], [0, 5], [1, 3, 4]]
    # A budget that holds everything: one micro-batch, cost 6 x 25 = 150.
    assert plan_micro_batches(prompt_lens, resp_lens, 150) == [[0, 1, 2, 3, 4, 5]]
    assert plan_micro_batches(prompt_lens, resp_lens, 149) != [[0, 1, 2, 3, 4, 5]]
    # A row longer than the budget still gets a micro-batch of its own.
    assert plan_micro_batches(prompt_lens, resp_lens, 10) == [[2], [5], [0], [3], [1], [4]]


def test_plan_min_count_splits_largest_group():
    # Equal lengths, budget 4 x 10: one group of 4 rows; min_count 3 halves it, then halves a half.
    plan = plan_micro_batches([5] * 4, [5] * 4, 40, min_count=3)
    assert plan == [[0], [1], [2, 3]]
    assert sorted(i for g in plan for i in g) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot split 4 rows into 5"):
        plan_micro_batches([5] * 4, [5] * 4, 40, min_count=5)
    with pytest.raises(ValueError, match="token_budget=0"):
        plan_micro_batches([5], [5], 0)


def test_plan_fits_budget_and_covers_every_row():
    g = torch.Generator().manual_seed(0)
    p = torch.randint(3, 30, (64,), generator=g).tolist()
    r = torch.randint(0, 64, (64,), generator=g).tolist()
    plan = plan_micro_batches(p, r, 256)
    assert sorted(i for grp in plan for i in grp) == list(range(64))
    for grp in plan:
        assert len(grp) * (max(p[i] for i in grp) + max(r[i] for i in grp)) <= 256


# ---------------------------------------------------------------- trim and scatter


def _samples(prompt_lens, resp_lens, vocab=512, seed=0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        out.append(
            Sample(
                uid=i // 2,
                prompt_ids=torch.randint(3, vocab, (p,), generator=g).tolist(),
                response_ids=torch.randint(3, vocab, (r,), generator=g).tolist(),
                rollout_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
                finish_reason="stop",
                score=float(i % 2),
                version=0,
                ref_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
            )
        )
    return out


def test_trim_padding_drops_only_unused_columns():
    # Batch P = 6, R = 9; rows 1 and 2 use at most 4 prompt and 3 response columns.
    batch = collate(_samples([6, 4, 3, 5], [9, 3, 2, 0]), pad_id=0)
    assert (batch.prompt_len, batch.response_mask.shape[1]) == (6, 9)
    mb = trim_padding(batch.select(torch.tensor([1, 2])))
    assert mb.prompt_len == 4 and mb.input_ids.shape == (2, 4 + 3) and mb.response_mask.shape == (2, 3)
    full = batch.select(torch.tensor([1, 2]))
    # The kept columns are exactly the untrimmed ones: positions are not recomputed.
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(getattr(mb, name), getattr(full, name)[:, 2:9])
    for name in ("response_mask", "rollout_logprobs", "ref_logprobs"):
        assert torch.equal(getattr(mb, name), getattr(full, name)[:, :3])
    assert torch.equal(mb.responses, full.responses[:, :3])
    # Nothing to trim: the same object back. A row with an empty response keeps one column.
    assert trim_padding(batch) is batch
    assert trim_padding(batch.select(torch.tensor([3]))).response_mask.shape == (1, 1)


def test_micro_batches_round_trip_through_scatter():
    batch = collate(_samples([6, 4, 3, 5, 2, 7], [9, 3, 2, 0, 12, 1]), pad_id=0)
    P, R = batch.prompt_len, batch.response_mask.shape[1]
    for micro, budget in ((4, 0), (4, 20), (4, 40)):
        parts = micro_batches(batch, micro, budget)
        back = scatter_rows([(idx, mb.rollout_logprobs) for idx, mb in parts], len(batch), R)
        assert torch.equal(back, batch.rollout_logprobs), (micro, budget)
        rows = torch.cat([idx for idx, _ in parts]).sort().values
        assert torch.equal(rows, torch.arange(len(batch)))
    # Count mode keeps the padded layout: contiguous rows of full width.
    parts = micro_batches(batch, 4, 0)
    assert [idx.tolist() for idx, _ in parts] == [[0, 1, 2, 3], [4, 5]]
    assert all(mb.input_ids.shape[1] == P + R for _, mb in parts)
    # Budget mode trims: every micro-batch is at most the budget wide x tall.
    for _, mb in micro_batches(batch, 4, 20):
        assert mb.input_ids.numel() <= 20 or len(mb) == 1


def test_sample_lengths():
    batch = collate(_samples([6, 4, 3], [9, 3, 0]), pad_id=0)
    assert sample_lengths(batch) == ([6, 4, 3], [9, 3, 0])


# ---------------------------------------------------------------- exact invariance through the model

PROMPTS = [7, 3, 12, 5, 9, 4, 6, 11, 3, 8, 5, 10]
RESPONSES = [2, 30, 5, 0, 17, 1, 9, 24, 3, 12, 6, 28]  # ragged, one empty


@pytest.fixture(scope="module")
def spec():
    from offstep.train.distributed import GroupSpec

    yield GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _batch():
    batch = collate(_samples(PROMPTS, RESPONSES, seed=1), pad_id=0)
    g = torch.Generator().manual_seed(2)
    batch.advantages = torch.randn(len(batch), 1, generator=g) * batch.response_mask
    return batch


def _actor(spec, budget: int, loss_agg_mode: str = "token-mean"):
    from offstep.models.loading import resolve_model
    from offstep.train.actor import ActorWorker

    actor_cfg = ActorConfig(micro_batch_size=4, micro_token_budget=budget)
    algo = AlgorithmConfig(loss_agg_mode=loss_agg_mode, entropy_coeff=0.01)
    return ActorWorker(spec, 0, str(resolve_model("tiny")), "float32", "float32", actor_cfg, algo, 1.0)


def test_trimmed_logprobs_equal_padded(spec):
    from offstep.models.forward import forward_response

    actor = _actor(spec, 0)
    batch = _batch()
    with torch.no_grad():
        padded = forward_response(actor.model, batch, 1.0, compute_dtype="float32")[0]
    counted, _ = actor.compute_logprobs(batch)  # 3 micro-batches of 4 padded rows
    actor.cfg.micro_token_budget = 60
    trimmed, _ = actor.compute_logprobs(batch)
    assert len(micro_batches(batch, 4, 60)) > 3  # the budget really splits and trims
    mask = batch.response_mask.bool()
    assert torch.allclose(counted[mask], padded[mask], atol=1e-5)
    assert torch.allclose(trimmed[mask], padded[mask], atol=1e-5)
    # Padding columns outside a micro-batch's trimmed width are never computed (left at 0).
    assert int((trimmed[~mask] != 0).sum()) < int((padded[~mask] != 0).sum())


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_budget_gradients_equal_count_gradients(spec, loss_agg_mode):
    """Same mini-batch, two micro-batch splits (4 rows each, padded; vs. token budget, trimmed):
    the accumulated gradients agree (DESIGN: different micro-batch splits give the same gradients)."""
    actor = _actor(spec, 0, loss_agg_mode)
    batch = _batch()
    denom = actor._denominator(batch, loss_agg_mode)

    def grads(budget: int) -> list[torch.Tensor]:
        actor.opt.zero_grad(set_to_none=True)
        for _, mb in actor._micro_batches(batch, 4, budget):
            actor._micro_step(mb, denom)
        out = [
            p.grad.full_tensor().clone() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for p in actor.model.parameters()
        ]
        actor.opt.zero_grad(set_to_none=True)
        return out

    by_count, by_budget = grads(0), grads(60)
    assert len(actor._micro_batches(batch, 4, 60)) != 3  # a different split from 3 x 4 rows
    assert any(float(g.abs().max()) > 0 for g in by_count)
    for a, b in zip(by_count, by_budget):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_update_with_budget_matches_count(spec):
    """The whole ActorWorker.update (metrics, grad norm, new weights) under both settings."""
    batch = _batch()
    results = []
    for budget in (0, 60):
        actor = _actor(spec, budget)
        metrics, _ = actor.update(batch)
        params = [
            p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in actor.model.parameters()
        ]
        results.append((metrics, params))
    (m0, p0), (m1, p1) = results
    for key in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- configuration


def test_budget_must_hold_the_longest_sample():
    cfg = load_config(["preset=tiny", "actor.micro_token_budget=50"])  # tiny: 96 + 12 = 108 tokens
    with pytest.raises(ConfigError, match=r"actor.micro_token_budget=50 .* 108"):
        validate(cfg, cpu_count=2, gpu_count=0)
    validate(load_config(["preset=tiny", "actor.micro_token_budget=108"]), cpu_count=2, gpu_count=0)


@pytest.mark.ray
def test_two_ranks_with_token_budget_run(tmp_path, ray_session):
    """FSDP2 over 2 ranks: each plans its own micro-batches; the counts are equalised so the
    collectives pair up (a mismatch would hang, not fail)."""
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl

    cfg = load_config(
        [
            "preset=tiny",
            "pipeline.max_staleness=0",
            "pipeline.colocate=true",
            "resources.trainer_workers=2",
            "trainer.total_steps=2",
            f"trainer.output_dir={tmp_path}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
            "actor.micro_token_budget=120",
        ]
    )
    train(cfg)
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["step"] >= 1]
    assert [m["policy_version"] for m in metrics] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
