"""The built-in PyTorch rollout engine (offstep.rollout.engines.torch_engine and its runners, offstep.rollout.engines.sampling)
on the tiny random model: what is its own (continuous batching, the runners, the sampler). What every
engine does is ``test_engine_contract.py``."""

from __future__ import annotations

import os

import pytest
import torch

from offstep.models.loading import (
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
    resolve_model,
)
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.types import Completion, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = ["What is 12 + 7?", "Hi", "Count the apples: one, two, three, four, five, six."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    old = os.environ.get("OFFSTEP_CACHE")
    os.environ["OFFSTEP_CACHE"] = str(tmp_path_factory.mktemp("offstep_cache"))
    try:
        path = resolve_model("tiny")
        tok = load_tokenizer(path)
        yield path, tok, load_causal_lm(path), eos_token_ids(tok, path)
    finally:
        if old is None:
            os.environ.pop("OFFSTEP_CACHE", None)
        else:
            os.environ["OFFSTEP_CACHE"] = old


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny[1]


@pytest.fixture(scope="module")
def model(tiny):
    return tiny[2]


@pytest.fixture(scope="module")
def engine(tiny):
    _, tok, model, eos = tiny
    return TorchEngine(model, tok, eos)


@pytest.fixture(scope="module")
def prompts(tok):
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False).input_ids)
    assert len({len(p) for p in out}) == len(out)  # different lengths: batches are left-padded
    return out


def _teacher_forced_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _key(cs):
    return [(c.prompt_index, c.response_ids, c.finish_reason, c.text) for c in cs]


# ------------------------------------------------------------------ basics


@pytest.mark.heavy
@pytest.mark.parametrize("runner", ["slots", "hf"])
def test_sub_batching_does_not_change_samples(tiny, prompts, runner):
    _, tok, model, eos = tiny
    p = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_new_tokens=12)
    big = TorchEngine(model, tok, eos, max_batch_size=64, runner=runner).generate(prompts, p, seed=5)
    small = TorchEngine(model, tok, eos, max_batch_size=2, runner=runner).generate(prompts, p, seed=5)
    assert _key(big) == _key(small)
    for x, y in zip(big, small):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)


@pytest.mark.heavy
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_logprobs_match_teacher_forcing(engine, model, prompts, temperature):
    out = engine.generate(prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=16), seed=7)
    for c in out:
        ref = _teacher_forced_logprobs(model, prompts[c.prompt_index], c.response_ids, temperature)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)


@pytest.mark.heavy
def test_hf_fallback_gives_same_results(tiny, prompts):
    # Models the slot runner does not cover use the model's own forward (DynamicCache, static
    # sub-batches); both paths must agree.
    _, tok, model, eos = tiny
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    fast = TorchEngine(model, tok, eos)
    plain = TorchEngine(model, tok, eos, runner="hf")
    assert (fast.runner, plain.runner) == ("slots", "hf")
    a, b = fast.generate(prompts, p, seed=8), plain.generate(prompts, p, seed=8)
    assert _key(a) == _key(b)
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


@pytest.mark.heavy
def test_long_generation_grows_the_cache(tiny, prompts):
    # The slot KV cache starts at prompt + 256 positions and grows: past that, results must stay exact.
    _, tok, model, _ = tiny
    engine = TorchEngine(model, tok, eos_ids=[10**6])  # an id never sampled: every sample runs to the limit
    out = engine.generate(prompts[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=300), seed=2)
    for c in out:
        assert len(c.response_ids) == 300 and c.finish_reason == "length"
        ref = _teacher_forced_logprobs(model, prompts[c.prompt_index], c.response_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


# ------------------------------------------------------------------ greedy


@pytest.mark.heavy
def test_greedy_matches_hf_generate(engine, model, tok, prompts):
    p = SamplingParams(temperature=0.0, max_new_tokens=24)
    for i, prompt in enumerate(prompts):
        (c,) = engine.generate([prompt], p, seed=0)
        ref = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=engine.eos_ids,
            pad_token_id=tok.pad_token_id,
        )
        assert c.response_ids == ref[0, len(prompt) :].tolist()
        # greedy log-probs are those of the untempered distribution
        want = _teacher_forced_logprobs(model, prompt, c.response_ids, 0.0)
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4)
    # Greedy ignores the seed.
    assert _key(engine.generate(prompts, p, seed=1)) == _key(engine.generate(prompts, p, seed=2))


@pytest.mark.heavy
def test_greedy_alone_equals_inside_padded_batch(engine, prompts):
    p = SamplingParams(temperature=0.0, max_new_tokens=20)
    short = min(range(len(prompts)), key=lambda i: len(prompts[i]))
    (alone,) = engine.generate([prompts[short]], p, seed=0)
    batch = engine.generate(prompts, p, seed=0)
    assert batch[short].response_ids == alone.response_ids
    assert torch.allclose(torch.tensor(batch[short].logprobs), torch.tensor(alone.logprobs), atol=1e-4)
    for i, prompt in enumerate(prompts):
        (single,) = engine.generate([prompt], p, seed=0)
        assert batch[i].response_ids == single.response_ids


# ------------------------------------------------------------------ stopping


def test_eos_stops_and_is_kept(tiny, prompts):
    _, tok, model, eos = tiny
    p = SamplingParams(n=3, temperature=1.0, max_new_tokens=24)
    base = TorchEngine(model, tok, eos).generate(prompts, p, seed=11)
    # Make a token that the first sample emits at position 3 an extra eos id.
    target = base[0].response_ids[3]
    out = TorchEngine(model, tok, [*eos, target]).generate(prompts, p, seed=11)
    for b, c in zip(base, out):
        if target in b.response_ids:
            cut = b.response_ids.index(target) + 1
            assert c.response_ids == b.response_ids[:cut] and c.finish_reason == "stop"
            assert c.logprobs == pytest.approx(b.logprobs[:cut], abs=1e-5)
        else:
            assert c.response_ids == b.response_ids and c.finish_reason == b.finish_reason
    assert out[0].finish_reason == "stop" and len(out[0].response_ids) <= 4


def _stop_string_completed_at(tok, ids, k):
    """A stop string that decode(ids[:k + 1]) contains but decode(ids[:k]) does not, or None."""
    prefix = tok.decode(ids[:k], skip_special_tokens=True)
    full = tok.decode(ids[: k + 1], skip_special_tokens=True)
    if not prefix or len(full) <= len(prefix) or not full.startswith(prefix) or "\ufffd" in full:
        return None
    stop = full[len(prefix) - 1 :]  # starts before token k, ends inside it
    return None if stop in prefix else stop


@pytest.mark.heavy
def test_stop_string_and_other_rows_unaffected(engine, tok, prompts):
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=24)
    base = engine.generate(prompts, p, seed=21)
    found = next(
        (i, k, s)
        for i, c in enumerate(base)
        for k in range(3, 12)
        if (s := _stop_string_completed_at(tok, c.response_ids, k)) is not None
    )
    i, k, stop = found
    out = engine.generate(prompts, SamplingParams(**{**p.__dict__, "stop": (stop,)}), seed=21)
    for b, c in zip(base, out):
        if stop in b.text:
            assert c.finish_reason == "stop" and stop in c.text
            assert b.response_ids[: len(c.response_ids)] == c.response_ids
            assert stop not in tok.decode(c.response_ids[:-1], skip_special_tokens=True)
        else:  # rows that did not stop are exactly as without the stop string (finished rows left the batch)
            assert (c.response_ids, c.finish_reason) == (b.response_ids, b.finish_reason)
            assert c.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert out[i].finish_reason == "stop" and len(out[i].response_ids) <= k + 1
    assert any(c.finish_reason == "length" for c in out)


@pytest.mark.heavy
def test_on_finish_called_once_per_sample_as_they_finish(tiny, prompts):
    _, tok, model, eos = tiny
    p = SamplingParams(n=3, temperature=1.0, max_new_tokens=24)
    base = TorchEngine(model, tok, eos).generate(prompts, p, seed=4)
    extra = base[4].response_ids[2]  # an extra eos id: some samples end early, at different steps
    engine = TorchEngine(model, tok, [*eos, extra])
    forwards = []  # one embedding lookup per forward pass, on either runner
    handle = model.get_input_embeddings().register_forward_hook(lambda *args: forwards.append(1))
    seen: list[tuple[Completion, int]] = []
    try:
        out = engine.generate(prompts, p, seed=4, on_finish=lambda c: seen.append((c, len(forwards))))
    finally:
        handle.remove()
    assert len(seen) == len(out) == 9
    assert sorted(id(c) for c, _ in seen) == sorted(map(id, out))  # once each, the very objects returned
    assert any(c.finish_reason == "stop" for c in out) and any(c.finish_reason == "length" for c in out)
    # One sub-batch: a sample with L tokens is reported right after its L-th token was sampled, i.e.
    # after the prefill and L - 1 decode forwards, while the others are still decoding.
    for c, n_forwards in seen:
        assert n_forwards == len(c.response_ids)


# ------------------------------------------------------------------ continuous batching


def _early_eos(tok, base, sample, at):
    """A token that ``base[sample]`` emits at index ``at`` and no other sample emits at all."""
    t = base[sample].response_ids[at]
    others = [c for i, c in enumerate(base) if i != sample]
    return None if any(t in c.response_ids for c in others) or t in base[sample].response_ids[:at] else t


@pytest.mark.heavy
def test_samples_do_not_depend_on_admission_time(tiny, prompts):
    # Samples finish at different steps (an extra eos id), so with few slots the later samples are
    # admitted into freed slots mid-flight, next to others at other positions. Every sample must
    # equal what it is with one slot per sample (all admitted at once) and with one slot in all.
    _, tok, model, eos = tiny
    p = SamplingParams(n=3, temperature=1.0, max_new_tokens=20)
    base = TorchEngine(model, tok, eos).generate(prompts, p, seed=31)
    extra = next(t for i in range(len(base)) for at in (2, 5) if (t := _early_eos(tok, base, i, at)) is not None)
    outs = {
        m: TorchEngine(model, tok, [*eos, extra], max_batch_size=m).generate(prompts, p, seed=31) for m in (1, 2, 4, 64)
    }
    assert any(c.finish_reason == "stop" for c in outs[64]) and any(c.finish_reason == "length" for c in outs[64])
    for m in (1, 2, 4):
        assert _key(outs[m]) == _key(outs[64]), m
        for x, y in zip(outs[m], outs[64]):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)


@pytest.mark.heavy
def test_freed_slot_is_refilled_at_the_next_step(tiny, prompts):
    # Two slots, three prompts: sample 0 ends after k tokens; prompt 2 must be prefilled in the very
    # next forward pass, together with sample 1's decode token, and nothing waits for sample 1.
    _, tok, model, _ = tiny
    never = 10**6  # an eos id that is never sampled: samples run to max_new_tokens
    p = SamplingParams(n=1, temperature=1.0, max_new_tokens=10)
    base = TorchEngine(model, tok, [never]).generate(prompts, p, seed=3)
    extra = next(t for at in (2, 3, 4) if (t := _early_eos(tok, base, 0, at)) is not None)
    k = base[0].response_ids.index(extra) + 1
    engine = TorchEngine(model, tok, [never, extra], max_batch_size=2)
    tokens_per_forward: list[int] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: tokens_per_forward.append(i[0].numel()))
    try:
        out = engine.generate(prompts, p, seed=3)
    finally:
        handle.remove()
    assert out[0].response_ids == base[0].response_ids[:k] and out[0].finish_reason == "stop"
    assert [c.response_ids for c in out[1:]] == [c.response_ids for c in base[1:]]
    lens = [len(q) for q in prompts]
    # forward 1: prefill prompts 0 and 1; forwards 2..k: decode 2 slots; forward k+1: decode sample 1
    # + prefill prompt 2; then 1 + 1 tokens until sample 1 ends after 10 forwards; then prompt 2 alone.
    assert tokens_per_forward[0] == lens[0] + lens[1]
    assert tokens_per_forward[1:k] == [2] * (k - 1)
    assert tokens_per_forward[k] == 1 + lens[2]
    assert len(tokens_per_forward) == k + 10  # prompt 2 ran its 10 tokens right behind sample 0


@pytest.mark.heavy
def test_shared_prompt_prefix_is_prefilled_once(tiny):
    # Prompts that share a system message: the common prefix is prefilled once, each prompt only
    # prefills the rest, and the samples are those of an engine that prefills every prompt whole.
    from offstep.rollout.engines.schedule import shared_prefix

    _, tok, model, eos = tiny
    system = "You are a helpful assistant. Answer the question step by step."
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        ).input_ids
        for q in QUESTIONS
    ]
    shared = shared_prefix(prompts)
    assert shared >= TorchEngine.min_shared_prefix
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    whole = TorchEngine(model, tok, eos)
    whole.min_shared_prefix = 10**6
    want = whole.generate(prompts, p, seed=12)
    engine = TorchEngine(model, tok, eos)
    tokens_per_forward: list[int] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: tokens_per_forward.append(i[0].numel()))
    try:
        got = engine.generate(prompts, p, seed=12)
    finally:
        handle.remove()
    assert tokens_per_forward[:2] == [shared, sum(len(q) - shared for q in prompts)]
    assert _key(got) == _key(want)
    for c, w in zip(got, want):
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(w.logprobs), atol=1e-4)
        ref = _teacher_forced_logprobs(model, prompts[c.prompt_index], c.response_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_runner_mixed_step_matches_model_forward(model):
    # One step that decodes running slots at different positions and prefills a new prompt into two
    # slots gives the model's own next-token logits for every sequence.
    from offstep.rollout.engines.llama_runner import LlamaRunner

    runner = LlamaRunner(model)
    a, b, c = [5, 9, 13, 2, 7], [4, 4, 8], [11, 3, 6, 1, 9, 10, 12]

    def ref(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float()

    with torch.inference_mode():
        cache = runner.new_cache(slots=4, capacity=4, limit=16)  # too small: the steps grow it
        first = runner.step(
            cache, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [a, b], [[0], [1]]
        )
        assert torch.allclose(first, torch.stack([ref(a), ref(b)]), atol=1e-4)
        mixed = runner.step(cache, torch.tensor([20, 21]), torch.tensor([len(a), len(b)]), [c], [[2, 3]])
        want = torch.stack([ref(a + [20]), ref(b + [21]), ref(c)])
        assert torch.allclose(mixed, want, atol=1e-4)
        # Compaction: move slot 3 (prompt c) into slot 1, then decode slots 0..2.
        cache.move(torch.tensor([3]), torch.tensor([1]), len(c))
        nxt = runner.step(cache, torch.tensor([22, 23, 24]), torch.tensor([len(a) + 1, len(c), len(c)]), [], [])
        want = torch.stack([ref(a + [20, 22]), ref(c + [23]), ref(c + [24])])
        assert torch.allclose(nxt, want, atol=1e-4)
        # A shared prefix: c[:4] is cached in slot 2 (written above); copy it into slot 3 and prefill
        # only the rest of a prompt that starts with it, next to a decode step of slots 0..2.
        cache.move(torch.tensor([2]), torch.tensor([3]), 4)
        d = c[:4] + [8, 8, 2]
        with_prefix = runner.step(
            cache,
            torch.tensor([25, 26, 27]),
            torch.tensor([len(a) + 2, len(c) + 1, len(c) + 1]),
            [d[4:]],
            [[3]],
            start=4,
        )
        want = torch.stack([ref(a + [20, 22, 25]), ref(c + [23, 26]), ref(c + [24, 27]), ref(d)])
        assert torch.allclose(with_prefix, want, atol=1e-4)


def _random_lm(kind, vocab):
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    kw = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    torch.manual_seed(0)
    if kind == "qwen2":  # Llama structure with q/k/v biases: served by the slot runner
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:  # q/k norms: not the Llama structure, falls back to the model's forward
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **kw))
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0, 0.3) if prm.ndim > 1 else prm.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.heavy
@pytest.mark.parametrize("kind,runner", [("qwen2", "slots"), ("qwen3", "hf")])
def test_other_architectures(tok, prompts, kind, runner):
    model = _random_lm(kind, len(tok))
    engine = TorchEngine(model, tok, [tok.eos_token_id])
    assert engine.runner == runner
    if runner == "hf":
        with pytest.raises(ValueError, match="runner='slots' cannot serve this model"):
            TorchEngine(model, tok, [tok.eos_token_id], runner="slots")
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=10), seed=1)
    for c in out:
        ref = _teacher_forced_logprobs(model, prompts[c.prompt_index], c.response_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    with pytest.raises(ValueError, match="runner="):
        TorchEngine(model, tok, [tok.eos_token_id], runner="vllm")


# ------------------------------------------------------------------ weights


@pytest.mark.heavy
def test_load_weights_changes_outputs_and_version(tiny, prompts):
    path, tok, _, eos = tiny
    model = load_causal_lm(path)  # a private copy: this test edits weights
    engine = TorchEngine(model, tok, eos)
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=16)
    before = engine.generate(prompts, p, seed=0)
    original = {k: v.clone() for k, v in model.state_dict().items()}

    new = {k: v.clone() for k, v in original.items() if k != "lm_head.weight"}  # tied head may be absent
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    new["model.embed_tokens.weight"][eos_id] *= 25.0  # make <|im_end|> very likely
    engine.load_weights(new, version=3)
    assert engine.version == 3
    assert torch.equal(model.lm_head.weight, new["model.embed_tokens.weight"])
    after = engine.generate(prompts, p, seed=0)
    assert _key(after) != _key(before)
    assert any(c.finish_reason == "stop" and c.response_ids[-1] == eos_id for c in after)
    for c in after:
        assert "<|im_end|>" not in c.text and c.extra.get("weight_version") == 3

    engine.load_weights(original, version=4)  # lm_head present as well: also fine
    assert engine.version == 4
    assert _key(engine.generate(prompts, p, seed=0)) == _key(before)


@pytest.mark.heavy
def test_runner_follows_repointed_parameters(tiny, prompts):
    # The slot runner reads q/k/v and gate/up through fused views of the model's parameters; if a
    # parameter is replaced (not copied into), the next step must use the new values, not stale ones
    # (the separate modules, as the parameters are no longer back to back).
    path, tok, _, eos = tiny
    model = load_causal_lm(path)
    engine = TorchEngine(model, tok, eos)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[0].mlp
    with torch.no_grad():
        attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5
        mlp.up_proj.weight.data = -mlp.up_proj.weight.data
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=10)
    for c in engine.generate(prompts, p, seed=6):
        ref = _teacher_forced_logprobs(model, prompts[c.prompt_index], c.response_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    # and in-place loads into the regrouped storage are seen as well
    sd = {k: v * 0.9 for k, v in model.state_dict().items()}
    engine.load_weights(sd, version=1)
    for c in engine.generate(prompts, p, seed=6):
        ref = _teacher_forced_logprobs(model, prompts[c.prompt_index], c.response_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["tiny", "qwen2"])
def test_runner_reads_weights_a_collective_receiver_repointed(tiny, prompts, kind):
    # The collective weight receiver moves every parameter into one flat buffer (in parameter order)
    # and broadcasts into it. The runner must generate from those live weights afterwards: q/k/v
    # stay back to back for Llama (fused GEMM on the flat buffer); Qwen2's biases interleave, so
    # there it must use the separate modules, and never move the parameters away again.
    from offstep.sync.collective import flatten_parameters, manifest, plan

    path, tok, _, eos = tiny
    model = load_causal_lm(path) if kind == "tiny" else _random_lm("qwen2", len(tok))
    engine = TorchEngine(model, tok, eos)
    assert engine.runner == "slots"
    specs = manifest(model)
    slots, totals, _ = plan(specs, bucket_bytes=1 << 16)
    flat = flatten_parameters(model, specs, slots, totals, torch.device("cpu"))
    with torch.no_grad():
        flat["float32"].mul_(0.8)  # what a broadcast of new weights does: write into the buffer
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=10)
    for c in engine.generate(prompts, p, seed=2):
        ref = _teacher_forced_logprobs(model, prompts[c.prompt_index], c.response_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    views = [prm.untyped_storage().data_ptr() for prm in model.parameters()]
    assert set(views) == {flat["float32"].untyped_storage().data_ptr()}  # still the receiver's buffer
