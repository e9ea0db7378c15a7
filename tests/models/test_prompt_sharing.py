"""Shared prompts (``actor.share_prompts``, offstep/models/prompt_sharing.py): the packed layout by
hand, the planner's units by hand, and the log-probs, entropy and gradients of the packed forward
against one padded row per sample, on two architectures, through the real actor worker too."""

from __future__ import annotations

import pytest
import torch

from offstep.batch import Sample, collate, micro_batches, prompt_groups, prompt_units, sample_lengths
from offstep.config.schema import ActorConfig, AlgorithmConfig
from offstep.models.forward import forward_response
from offstep.models.prompt_sharing import shared_layout


def _sample(uid, prompt, response, score=0.0) -> Sample:
    return Sample(
        uid=uid,
        prompt_ids=list(prompt),
        response_ids=list(response),
        rollout_logprobs=[-1.0] * len(response),
        finish_reason="stop",
        score=score,
        version=0,
    )


# ---------------------------------------------------------------- the layout by hand


def test_layout_hand_worked():
    # Prompt A = [5, 6] with responses [7, 8] and [9]; prompt B = [1, 2, 3] with response [4, 4].
    batch = collate([_sample(0, [5, 6], [7, 8]), _sample(1, [1, 2, 3], [4, 4]), _sample(0, [5, 6], [9])], pad_id=0)
    assert prompt_groups(batch) == [[0, 2], [1]]
    lay = shared_layout(batch)
    # Prompts end at column 3 (the longest is 3); responses follow end to end: A holds 2 + 1.
    assert lay.input_ids.tolist() == [[0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 4, 0]]
    assert lay.position_ids.tolist() == [[0, 0, 1, 2, 3, 2], [0, 1, 2, 3, 4, 0]]
    assert lay.row.tolist() == [0, 1, 0]
    # Kept columns start at the prompts' last (column 2): 4 of them. Token t of a response is
    # predicted by kept column 0 (t = 0) or by its own token t - 1's column.
    assert lay.keep == 4
    assert lay.index.tolist() == [[0, 1], [0, 1], [0, 0]]  # row 2's second column is padding
    m = lay.attention_mask[:, 0].int()
    # Row A: column 5 (the response [9]) sees the prompt (1, 2) and itself, not [7, 8].
    assert m[0, 5].tolist() == [0, 1, 1, 0, 0, 1]
    assert m[0, 4].tolist() == [0, 1, 1, 1, 1, 0]
    assert m[0, 0].tolist() == [1, 0, 0, 0, 0, 0]  # a pad column sees itself only: no empty row
    # Row B: the trailing pad sees pads only; the response sees the prompt and itself, causally.
    assert m[1, 4].tolist() == [1, 1, 1, 1, 1, 0]
    assert m[1, 5].tolist() == [0, 0, 0, 0, 0, 1]


def test_units_hand_worked():
    # Two prompts: rows 0, 1, 2 share prompt length 4; rows 3, 4 share length 6.
    groups = [[0, 1, 2], [3, 4]]
    prompt_lens = [4, 4, 4, 6, 6]
    response_lens = [5, 3, 6, 2, 2]
    # Budget 20: group one costs 4 + 5 + 3 + 6 = 18 as one unit, group two 6 + 2 + 2 = 10.
    assert prompt_units(groups, prompt_lens, response_lens, 20) == [[0, 1, 2], [3, 4]]
    # Budget 12: 4 + 5 + 3 = 12 fits, + 6 does not: [0, 1], [2]; group two fits.
    assert prompt_units(groups, prompt_lens, response_lens, 12) == [[0, 1], [2], [3, 4]]
    # min_count 4 halves the unit with most rows (the first of equals): [0, 1, 2] into [0] and
    # [1, 2], then [1, 2] (before [3, 4]) into [1] and [2].
    assert prompt_units(groups, prompt_lens, response_lens, 20, min_count=4) == [[0], [1], [2], [3, 4]]
    with pytest.raises(ValueError, match="cannot split 2 rows into 3"):
        prompt_units([[0, 1]], [4, 4], [1, 1], 20, min_count=3)
    # No budget: a packed sequence is at most twice the group's longest sample (2 x (2 + 3) = 10),
    # so four responses of 3 after a prompt of 2 (14 tokens) go in two: 2 + 3 + 3 = 8, + 3 = 11 > 10.
    assert prompt_units([[0, 1, 2, 3]], [2] * 4, [3] * 4) == [[0, 1], [2, 3]]


def test_shared_micro_batches_keep_prompts_together():
    g = torch.Generator().manual_seed(0)
    samples = []
    for uid in range(6):
        prompt = torch.randint(3, 100, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        samples += [
            _sample(
                uid,
                prompt,
                torch.randint(3, 100, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist(),
            )
            for _ in range(4)
        ]
    batch = collate(samples, pad_id=0)
    prompt_lens, response_lens = sample_lengths(batch)
    parts = micro_batches(batch, 4, 60, share_prompts=True)
    rows = sorted(int(i) for idx, _ in parts for i in idx)
    assert rows == list(range(len(batch)))
    for idx, mb in parts:
        groups = prompt_groups(mb)
        width = max(prompt_lens[int(idx[g[0]])] for g in groups) + max(
            sum(response_lens[int(idx[b])] for b in g) for g in groups
        )
        assert len(groups) * width <= 60 or len(groups) == 1
    # the rows of each unit (a prompt's rows, cut to the budget and to twice its longest sample)
    # land in one micro-batch together
    where = {int(i): k for k, (idx, _) in enumerate(parts) for i in idx}
    units = prompt_units(prompt_groups(batch), prompt_lens, response_lens, 60)
    assert len(units) < len(batch)
    assert all(len({where[b] for b in unit}) == 1 for unit in units)


# ---------------------------------------------------------------- equal to one row per sample


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(cfg).eval()


def _llama():
    from offstep.models.loading import load_causal_lm, resolve_model

    return load_causal_lm(str(resolve_model("tiny")), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return _llama() if request.param == "llama" else _qwen2()


def _grouped_batch(vocab: int, n: int = 4, prompts: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for uid in range(prompts):
        prompt = torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            r = int(torch.randint(0, 16, (1,), generator=g))
            samples.append(_sample(uid, prompt, torch.randint(3, vocab, (r,), generator=g).tolist()))
    return collate(samples, pad_id=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_equal_rows(model, temperature):
    batch = _grouped_batch(model.config.vocab_size)
    mask = batch.response_mask.bool()
    with torch.no_grad():
        rows, rows_ent = forward_response(model, batch, temperature, True)
        shared, shared_ent = forward_response(model, batch, temperature, True, share_prompts=True)
    assert shared.shape == rows.shape
    torch.testing.assert_close(shared[mask], rows[mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(shared_ent[mask], rows_ent[mask], rtol=0, atol=2e-5)


def test_bfloat16_autocast_equal_rows_to_bf16_rounding(model):
    batch = _grouped_batch(model.config.vocab_size, seed=3)
    mask = batch.response_mask.bool()
    with torch.no_grad():
        exact = forward_response(model, batch, 1.0)[0]
        rows = forward_response(model, batch, 1.0, compute_dtype="bfloat16")[0]
        shared = forward_response(model, batch, 1.0, compute_dtype="bfloat16", share_prompts=True)[0]
    # packing moves bf16 rounding no further from float32 than separate rows do (with slack)
    assert float((shared - exact)[mask].abs().max()) <= 2 * float((rows - exact)[mask].abs().max()) + 1e-3


def test_gradients_equal_rows(model):
    batch = _grouped_batch(model.config.vocab_size, seed=1)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(5)) * batch.response_mask

    def grads(share: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logp, ent = forward_response(model, batch, 1.0, True, share_prompts=share)
        ((logp * weights).sum() + 0.1 * (ent * batch.response_mask).sum()).backward()
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    rows, shared = grads(False), grads(True)
    assert any(float(g.abs().max()) > 0 for g in rows)
    for a, b in zip(rows, shared):  # to float32 rounding of sums over many tokens: relative to each tensor's scale
        assert float((b - a).abs().max()) <= 1e-5 * float(a.abs().max()) + 1e-8


def test_a_long_group_packs_in_several_sequences_and_still_equals_rows():
    from offstep.batch import prompt_units as units_of

    model = _llama()
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 500, (3,), generator=g).tolist()
    batch = collate(
        [_sample(0, prompt, torch.randint(3, 500, (10,), generator=g).tolist()) for _ in range(4)], pad_id=0
    )
    assert units_of(prompt_groups(batch), *sample_lengths(batch)) == [[0, 1], [2, 3]]  # 3 + 4 x 10 > 2 x 13
    mask = batch.response_mask.bool()
    with torch.no_grad():
        rows = forward_response(model, batch, 1.0)[0]
        shared = forward_response(model, batch, 1.0, share_prompts=True)[0]
    torch.testing.assert_close(shared[mask], rows[mask], rtol=0, atol=2e-5)


def test_distinct_prompts_run_unpacked():
    """n = 1 (no prompt repeats): nothing to share, the padded rows run as they are, bit for bit."""
    model = _llama()
    batch = collate([_sample(i, [3 + i, 4, 5], [6, 7 + i]) for i in range(3)], pad_id=0)
    with torch.no_grad():
        rows = forward_response(model, batch, 1.0)[0]
        shared = forward_response(model, batch, 1.0, share_prompts=True)[0]
    assert torch.equal(rows, shared)


def test_lora_model_equal_rows():
    from offstep.config.schema import LoRAConfig
    from offstep.models.lora import add_adapters

    torch.manual_seed(0)
    model = add_adapters(_llama(), LoRAConfig(rank=4, alpha=8))
    for name, p in model.named_parameters():  # adapters that change the output (B starts at zero)
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    model.eval()
    batch = _grouped_batch(model.config.vocab_size, seed=2)
    mask = batch.response_mask.bool()
    with torch.no_grad():
        rows = forward_response(model, batch, 1.0)[0]
        shared = forward_response(model, batch, 1.0, share_prompts=True)[0]
        with model.disable_adapter():
            base = forward_response(model, batch, 1.0, share_prompts=True)[0]
    torch.testing.assert_close(shared[mask], rows[mask], rtol=0, atol=2e-5)
    assert float((base - shared)[mask].abs().max()) > 1e-3  # the adapters did change the output


# ---------------------------------------------------------------- through the actor worker


@pytest.fixture(scope="module")
def spec():
    from offstep.train.distributed import GroupSpec

    yield GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("budget", [0, 120])
def test_update_with_shared_prompts_matches_rows(spec, budget):
    """The whole ActorWorker.update (metrics, grad norm, new weights), prompts shared or not, with
    padded micro-batches of 4 rows (0) and with a token budget planned by prompt (120)."""
    from offstep.models.loading import resolve_model
    from offstep.train.actor import ActorWorker

    batch = _grouped_batch(512, n=4, prompts=4, seed=4)
    g = torch.Generator().manual_seed(2)
    batch.advantages = torch.randn(len(batch), 1, generator=g) * batch.response_mask
    batch.ref_logprobs = batch.rollout_logprobs - 0.05 * batch.response_mask
    results = []
    for share in (False, True):
        actor_cfg = ActorConfig(micro_batch_size=4, micro_token_budget=budget, share_prompts=share)
        algo = AlgorithmConfig(entropy_coeff=0.01, use_kl_loss=True, kl_coef=0.1)
        actor = ActorWorker(spec, 0, str(resolve_model("tiny")), "float32", "float32", actor_cfg, algo, 1.0)
        old, _ = actor.compute_logprobs(batch)
        metrics, _ = actor.update(batch)
        params = [
            p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in actor.model.parameters()
        ]
        results.append((old, metrics, params))
    (o0, m0, p0), (o1, m1, p1) = results
    mask = batch.response_mask.bool()
    torch.testing.assert_close(o1[mask], o0[mask], rtol=0, atol=2e-5)
    for key in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
