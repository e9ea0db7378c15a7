"""The contract of a rollout engine (``offstep.rollout.engines.interface.RolloutEngine``), one suite over
both engines (``conftest.ENGINES_IN_PROCESS``: the built-in one and vLLM, whose case runs in a
pytest process of its own, ``own_process``), on the built-in tiny random Llama. What only one
engine does is tested in its own file: ``test_engine.py`` (continuous batching, the runners) and
``test_vllm_engine.py`` (against the built-in engine and the trainer's log-probs)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ENGINES_IN_PROCESS, assert_implements

from offstep.rollout.engines.interface import RolloutEngine
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.types import Completion, SamplingParams

QUESTIONS = ["What is 12 + 7?", "Hi", "Count the apples: one, two, three, four, five, six."]
EXACT = 1e-4  # log-probs against the model's own forward, float32 on CPU
THREADS = min(2, os.cpu_count() or 1)


@pytest.fixture(scope="module", params=ENGINES_IN_PROCESS)
def engine(request, tiny):
    path, tok, model, eos = tiny
    if request.param == "vllm":
        from offstep.rollout.engines.vllm_engine import VLLMEngine

        built = VLLMEngine(path, tok, eos, dtype="float32", num_threads=THREADS)
    else:
        built = TorchEngine(model, tok, eos)
    yield built
    built.close()


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[1]
    out = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        for q in QUESTIONS
    ]
    assert len({len(p) for p in out}) == len(out)  # different lengths: batches are padded or packed
    return out


def _key(cs):
    return [(c.prompt_index, c.response_ids, c.finish_reason, c.text) for c in cs]


def _teacher_forced_logprobs(model, prompt, response, temperature=1.0):
    with torch.no_grad():
        logits = (
            model(torch.tensor([prompt + response]))
            .logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)]
            .float()
        )
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


# ------------------------------------------------------------------ the interface and the order


def test_protocol_order_and_text(engine, prompts):
    # Every method of the interface, with a signature its callers can use (isinstance against the
    # Protocol only checks that the names exist).
    assert_implements(engine, RolloutEngine)
    assert engine.version == 0
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8), seed=1)
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for c in out:
        assert (
            isinstance(c, Completion)
            and c.extra.get("weight_version") == 0
            and set(c.extra) <= {"weight_version", "kv_age"}
        )
        assert len(c.response_ids) == len(c.logprobs) <= 8
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.text == engine.tokenizer.decode(c.response_ids, skip_special_tokens=True)


# ------------------------------------------------------------------ sampling


@pytest.mark.heavy
def test_seed_reproduces_and_samples_differ(engine, prompts):
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=16)
    a, b, c = (engine.generate(prompts, p, seed=s) for s in (123, 123, 124))
    assert _key(a) == _key(b) and [x.logprobs for x in a] == [x.logprobs for x in b]
    assert _key(a) != _key(c)
    assert len({tuple(x.response_ids) for x in a[:4]}) > 1  # the n samples of a prompt differ


@pytest.mark.heavy
def test_sample_does_not_depend_on_the_batch(engine, prompts):
    # Sample i is seeded from (seed, i): prompt 0's samples are the same alone and in a batch.
    p = SamplingParams(n=3, temperature=1.0, max_new_tokens=16)
    alone, batch = engine.generate(prompts[:1], p, seed=5), engine.generate(prompts, p, seed=5)[:3]
    assert _key(alone) == _key(batch)
    for x, y in zip(alone, batch):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=EXACT)


@pytest.mark.heavy
@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (20, 0.6)])
def test_logprobs_with_top_k_top_p(engine, tiny, prompts, top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    model, t = tiny[2], 0.8
    out = engine.generate(
        prompts, SamplingParams(n=2, temperature=t, top_k=top_k, top_p=top_p, max_new_tokens=12), seed=3
    )
    for c in out:
        prompt, resp = prompts[c.prompt_index], c.response_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : -1] / t
        if top_k:
            logits = TopKLogitsWarper(top_k)(None, logits)
        if top_p < 1:
            logits = TopPLogitsWarper(top_p)(None, logits)
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
        assert torch.isfinite(want).all()  # every sampled token lies inside the filtered support
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=EXACT)


def test_top_k_1_equals_greedy(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16), seed=0)
    topk1 = engine.generate(prompts, SamplingParams(n=2, temperature=1.3, top_k=1, max_new_tokens=16), seed=9)
    assert [c.response_ids for c in topk1] == [g.response_ids for g in greedy for _ in range(2)]
    assert all(lp == 0.0 for c in topk1 for lp in c.logprobs)  # a point mass after top-k = 1


def test_base_logprobs_are_teacher_forced(engine, tiny, prompts):
    """The reference's log-probs (no adapters: the model itself) are the model's teacher-forced
    ones; an empty response has none."""
    out = engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=10), seed=2)
    sequences = [(prompts[c.prompt_index], c.response_ids) for c in out] + [(prompts[0], [])]
    scored = engine.base_logprobs(sequences, 1.0)
    assert len(scored) == len(sequences) and scored[-1] == []
    for (prompt, response), got in zip(sequences[:-1], scored):
        want = _teacher_forced_logprobs(tiny[2], prompt, response)
        assert torch.allclose(torch.tensor(got), want, atol=EXACT)


# ------------------------------------------------------------------ stopping


def test_max_new_tokens(engine, prompts):
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5), seed=1)  # no eos drawn by either engine
    assert all(c.finish_reason == "length" and len(c.response_ids) == 5 for c in out)
    empty = engine.generate(prompts[:1], SamplingParams(n=2, max_new_tokens=0), seed=0)
    assert [(c.response_ids, c.finish_reason, c.text) for c in empty] == [([], "length", "")] * 2


def test_on_finish_called_once_per_sample(engine, prompts):
    seen: list[Completion] = []
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=10), seed=4, on_finish=seen.append)
    assert len(seen) == len(out) == 6
    assert {id(c) for c in seen} == {id(c) for c in out}  # once each, the very objects returned


def test_bad_inputs(engine, prompts):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams(), seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[10**6]], SamplingParams(), seed=0)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(prompts, SamplingParams(top_p=0.0), seed=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(prompts, SamplingParams(temperature=-1.0), seed=0)
    with pytest.raises(ValueError, match="not a string"):
        engine.generate(prompts, SamplingParams(stop="x"), seed=0)  # type: ignore[arg-type]
    assert engine.generate([], SamplingParams(), seed=0) == []


# ------------------------------------------------------------------ weights


def test_load_weights_errors(engine, tiny):
    """A state dict that does not fit is refused before anything is loaded, naming what is wrong."""
    sd = dict(tiny[2].state_dict())
    with pytest.raises(KeyError, match=r"missing \['model\.norm\.weight'\]"):
        engine.load_weights({k: v for k, v in sd.items() if k != "model.norm.weight"}, 5)
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights({k: v for k, v in sd.items() if "layers.0.mlp" not in k}, 5)
    with pytest.raises(KeyError, match=r"unexpected \['module\.extra'\]"):
        engine.load_weights({**sd, "module.extra": torch.zeros(1)}, 5)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.load_weights({**sd, "model.norm.weight": torch.ones(3)}, 5)
    assert engine.version == 0
    engine.reset_cache()
