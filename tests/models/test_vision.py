"""Vision-language models (``offstep.models.vision``) on the tiny random Qwen2-VL (``model.path=tiny_vl``):
the alias builds and reloads, images reach the logits, the built-in engine's prefill and decode (and the
partial-rollout recompute prefill) equal one full forward, and the engine's log-probs equal the
trainer's (``forward_response`` on the collated batch with its images) at micro-batch sizes 1 and 4."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image, ImageDraw

from offstep.batch import Sample, collate
from offstep.data.dataset import PromptRecord, encode_prompts
from offstep.data.image_spec import image_spec
from offstep.models.forward import forward_response, response_logits
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from offstep.models.vision import (
    ImageInputs,
    load_image_processor,
    mrope_positions,
    pixel_inputs,
    vision_token_ids,
)
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.types import SamplingParams

pytestmark = pytest.mark.heavy


def _png(size: tuple[int, int], count: int, colour: str = "red") -> bytes:
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    for i in range(count):
        d.rectangle([3 + 12 * i, 10, 12 + 12 * i, 22], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl():
    path = resolve_model("tiny_vl")
    tok = load_tokenizer(path)
    return path, tok, load_causal_lm(path), eos_token_ids(tok, path), load_image_processor(path)


def _prompts(vl, rows):
    """``rows``: (text with <image>, [image bytes]) -> encoded prompts through the data path."""
    path, tok = vl[0], vl[1]
    records = [
        PromptRecord(
            index=i, data_source="shapes", messages=[{"role": "user", "content": t}], ground_truth="1", images=im
        )
        for i, (t, im) in enumerate(rows)
    ]
    return encode_prompts(records, tok, 256, image_spec=image_spec(path))


def test_the_alias_builds_reloads_and_images_reach_the_logits(vl):
    path, tok, model, _, ip = vl
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert type(ip).__name__.startswith("Qwen2VLImageProcessor")
    banned = vision_token_ids(model.config)
    assert banned == sorted(
        tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    )
    assert vision_token_ids(load_causal_lm(resolve_model("tiny")).config) == []
    # a 56x56 image: grid [1, 4, 4], 4 image tokens; a 112x56 one: 8
    enc = _prompts(vl, [("<image>How many?", [_png((56, 56), 1)]), ("<image>How many?", [_png((112, 56), 3)])])
    assert [p.prompt_ids.count(model.config.image_token_id) for p in enc] == [4, 8]
    last = []
    for p in enc[:1] + _prompts(vl, [("<image>How many?", [_png((56, 56), 3, "blue")])]):
        pics = pixel_inputs(ip, p.images)
        ids = torch.tensor([p.prompt_ids])
        pos, _ = mrope_positions(model, ids, torch.ones_like(ids), pics.grid_thw)
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=pos, pixel_values=pics.pixel_values, image_grid_thw=pics.grid_thw)
        assert torch.isfinite(out.logits).all()
        last.append(torch.softmax(out.logits[0, -1], -1))
    # same text, different picture: the next-token distribution moves (total variation)
    assert float((last[0] - last[1]).abs().sum() / 2) > 1e-3


def test_prefill_and_decode_equal_a_full_forward_and_the_recompute_prefill(vl):
    path, tok, model, eos, ip = vl
    engine = TorchEngine(model, tok, eos, max_batch_size=8)
    runner = engine._fallback
    assert runner is not None, "a VL model is served by the HF runner"
    enc = _prompts(
        vl,
        [("<image>Count.", [_png((56, 56), 2)]), ("Two <image> and <image>?", [_png((84, 56), 1), _png((28, 28), 0)])],
    )
    pics = [pixel_inputs(ip, p.images) for p in enc]
    prompts = [p.prompt_ids for p in enc]
    gen = [11, 42, 7]  # tokens fed after each prompt (not vision tokens)
    with torch.no_grad():
        # n > 1: prompt 1 expands to two rows
        logits, batch = runner.prefill(prompts, [0, 1, 1], pics)
        steps = [logits]
        for t in gen:
            steps.append(runner.decode(batch, torch.tensor([t] * 3)))
        for row, u in enumerate([0, 1, 1]):
            ids = torch.tensor([prompts[u] + gen])
            pos, _ = mrope_positions(model, ids, torch.ones_like(ids), pics[u].grid_thw)
            full = (
                model(
                    input_ids=ids, position_ids=pos, pixel_values=pics[u].pixel_values, image_grid_thw=pics[u].grid_thw
                )
                .logits[0, -len(gen) - 1 :]
                .float()
            )
            got = torch.stack([s[row] for s in steps])
            torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)
        # the recompute prefill of a partial rollout: prompt + tokens so far, then one decode step
        _, again = runner.prefill([prompts[1] + gen[:-1]], [0], [pics[1]])
        nxt = runner.decode(again, torch.tensor([gen[-1]]))
        torch.testing.assert_close(nxt[0], steps[-1][1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_trainers_with_images(vl, temperature):
    path, tok, model, eos, ip = vl
    engine = TorchEngine(model, tok, eos, max_batch_size=8)
    enc = _prompts(
        vl,
        [
            ("<image>How many shapes?", [_png((56, 56), 2)]),
            ("What is 2 + 3?", []),  # a text row in the same batch
            ("<image> and <image>: how many?", [_png((112, 56), 3, "green"), _png((28, 56), 1)]),
        ],
    )
    pics = [pixel_inputs(ip, p.images) for p in enc]
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=10)
    out = engine.generate([p.prompt_ids for p in enc], params, seed=3, images=pics)
    banned = set(vision_token_ids(model.config))
    assert all(not banned & set(c.response_ids) for c in out), "a vision token was sampled"
    assert sum(len(c.response_ids) for c in out) > 6
    samples = [
        Sample(
            uid=c.prompt_index,
            prompt_ids=enc[c.prompt_index].prompt_ids,
            response_ids=c.response_ids,
            rollout_logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            score=0.0,
            version=0,
        )
        for c in out
    ]
    batch = collate(samples, engine.pad_id)
    batch.images = {u: pics[u] for u in range(len(enc)) if pics[u] is not None}
    assert isinstance(batch.images[0], ImageInputs)
    with torch.no_grad():
        _check_trainer(model, batch, temperature, banned)


def _check_trainer(model, batch, temperature, banned):
    logits = response_logits(model, batch, temperature)
    assert (logits[..., sorted(banned)] == torch.finfo(torch.float32).min).all(), "the trainer bans vision tokens"
    assert torch.isfinite(forward_response(model, batch, temperature, with_entropy=True)[1]).all()
    for mbs in (1, 4):
        for share in (False, True):  # the shared-prompt layout is skipped with images: still exact
            parts = [forward_response(model, mb, temperature, share_prompts=share)[0] for mb in batch.chunks(mbs)]
            logp = torch.cat(parts)
            diff = ((logp - batch.rollout_logprobs) * batch.response_mask).abs().max()
            assert float(diff) < 1e-4, f"micro-batch {mbs}, share_prompts={share}: max |engine - trainer| = {diff}"
    # without the images the trainer's log-probs differ: the test can fail
    batch.images = None
    bad = forward_response(model, batch.select(slice(0, 2)), temperature)[0]
    assert float(((bad - batch.rollout_logprobs[:2]) * batch.response_mask[:2]).abs().max()) > 1e-3


def test_decoder_layers_of_text_and_vl_models(vl, tiny):
    from offstep.models.vision import decoder_layers

    model = vl[2]
    assert list(decoder_layers(model)) == list(model.model.language_model.layers) and len(decoder_layers(model)) == 2
    # the vision blocks stay in the root FSDP unit: none of them is a decoder layer
    assert not {id(b) for b in model.model.visual.blocks} & {id(x) for x in decoder_layers(model)}
    text = tiny[2]
    assert list(decoder_layers(text)) == list(text.model.layers)


def test_a_stream_group_with_an_image_suspended_and_restored_equals_an_uninterrupted_one(vl):
    """``pipeline.mode=fully_async``: a replica's stream (``StreamServer``) gives each sample's engine request
    its prompt's images, a suspended sample's continuation too (prompt, images and tokens so far prefilled
    again). A group suspended mid-way, stored as a checkpoint stores it (its sample states as dicts, its
    request rebuilt from the prompt) and submitted to a new stream, draws what an uninterrupted group
    draws, and its log-probs equal the trainer's on the prompt with its image."""
    import dataclasses
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from offstep.rollout.replica_spec import Request
    from offstep.rollout.stream.replica_stream import GroupWork, SampleState, StreamServer

    path, tok, model, eos, ip = vl
    (enc,) = _prompts(vl, [("<image>How many shapes are there?", [_png((56, 56), 2)])])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16)
    pixels_of = []  # the requests the stream asked the pixels of

    def server_and_engine():
        engine = TorchEngine(model, tok, [10_000_000 % len(tok)], max_batch_size=8)  # an eos not met early
        pool = ThreadPoolExecutor(1)

        def pixels(r):
            pixels_of.append(r.uid)
            return pixel_inputs(ip, r.images)

        args = (engine, [enc.prompt_ids], params, "recompute", 8, lambda r, text, info=None: (0.0, {}), pool, tok)
        return StreamServer(*args, pixels=pixels), engine

    def request():  # as a resume rebuilds it: from the prompt (offstep.pipeline.inputs.to_request)
        return Request(uid=7, prompt_ids=enc.prompt_ids, data_source="shapes", ground_truth="2", images=enc.images)

    def take(server):
        for _ in range(120):
            if out := server.take(1.0):
                return out[0].samples
        raise AssertionError("the group did not finish")

    server, _ = server_and_engine()
    try:
        server.submit([GroupWork(request(), seed=3, stream0=0)])
        whole = take(server)
    finally:
        server.close()
    assert all(len(s.response_ids) == params.max_new_tokens for s in whole)

    server, engine = server_and_engine()
    hit, append, count = threading.Event(), engine._append, [0]

    def counting(*args):  # after 6 tokens in all, a suspension lands at the next step boundary
        count[0] += 1
        if count[0] == 6:
            server.control.post_suspend()
            hit.set()
        return append(*args)

    engine._append = counting
    try:
        server.submit([GroupWork(request(), seed=3, stream0=0)])
        assert hit.wait(60)
        (work,) = server.suspend()
    finally:
        server.close()
    stored = [dataclasses.asdict(s) for s in work.samples]  # as the checkpoint's JSON holds them
    assert all(0 < len(s["tokens"]) < params.max_new_tokens and not s["finish_reason"] for s in stored), stored
    server, _ = server_and_engine()
    try:
        server.submit([GroupWork(request(), 3, 0, [SampleState(**s) for s in stored])])
        resumed = take(server)
    finally:
        server.close()
    assert pixels_of == [7, 7, 7], "one pixel computation a submitted group"
    for a, b in zip(whole, resumed):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(
            torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-4, rtol=0
        )
    batch = collate(resumed, engine.pad_id)
    batch.images = {7: pixel_inputs(ip, enc.images)}
    with torch.no_grad():
        logp = forward_response(model, batch, 1.0)[0]
    assert float(((logp - batch.rollout_logprobs) * batch.response_mask).abs().max()) < 1e-4


def test_the_rollout_side_reference_takes_the_images(vl):
    """``pipeline.ref_on_rollout=true``: the rollout worker's reference log-probs of image prompts, in batch
    mode (``generate``) and from the stream (``stream_take``), equal the trainer-side reference's
    (``forward_response`` of the initial policy on the collated batch with its images). The stream's
    finished groups leave the worker without their pixels."""
    from offstep.pipeline.inputs import to_request
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import RefSpec, RolloutSpec
    from offstep.rollout.stream.replica_stream import GroupWork
    from offstep.rollout.worker import RolloutWorker

    path, tok, model, eos, ip = vl
    enc = _prompts(
        vl, [("<image>How many?", [_png((56, 56), 2)]), ("What is 2 + 3?", []), ("<image>Count.", [_png((84, 56), 1)])]
    )
    ref = RefSpec("float32", "float32", 1.0, 2)
    worker = RolloutWorker(RolloutSpec.local(path, RewardFunction(), 8, ref=ref))
    params = SamplingParams(n=2, max_new_tokens=8)
    requests = [to_request(p, uid) for uid, p in enumerate(enc)]
    samples, _ = worker.generate(requests, params, seed=1)
    worker.stream_start([p.prompt_ids for p in enc], params, "recompute")
    worker.stream_submit([GroupWork(to_request(enc[0], 10), seed=3, stream0=0)])
    taken = []
    for _ in range(120):
        if taken := worker.stream_take(1.0):
            break
    assert taken and taken[0].images is None, "the pixels stay on the replica"
    worker._stream.close()
    pics = {u: pixel_inputs(ip, p.images) for u, p in enumerate(enc) if p.images}
    pics[10] = pics[0]
    for group in (samples, taken[0].samples):
        batch = collate(group, worker.pad_id)
        batch.images = {u: pics[u] for u in set(batch.group_ids.tolist()) if u in pics}
        with torch.no_grad():
            want = forward_response(model, batch, 1.0)[0]
            diff = ((want - batch.ref_logprobs) * batch.response_mask).abs().max()
            assert float(diff) < 1e-5, f"max |rollout-side reference - trainer's| = {diff}"
            batch.images = None  # without the images the reference differs: the test can fail
            blind = forward_response(model, batch, 1.0)[0]
        assert float(((blind - batch.ref_logprobs) * batch.response_mask).abs().max()) > 1e-3
