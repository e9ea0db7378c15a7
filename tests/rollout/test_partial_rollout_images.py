"""A partial rollout of image prompts on the built-in engine (``rollout.partial=recompute``): a
weight load lands between decode steps and the running samples' prompts, their images and their
tokens so far are prefilled again. Loading the same weights must change nothing: the tokens and
log-probs equal those of an uninterrupted run (a recompute without the images would not)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image, ImageDraw

from offstep.data.dataset import PromptRecord, encode_prompts
from offstep.data.image_spec import image_spec
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from offstep.models.vision import load_image_processor, pixel_inputs
from offstep.rollout.engines.control import StepControl
from offstep.rollout.engines.plain_generation import PromptFeed
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.types import SamplingParams

pytestmark = pytest.mark.heavy

PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=10)


def _png(w: int, count: int) -> bytes:
    img = Image.new("RGB", (w, 56), "white")
    for i in range(count):
        ImageDraw.Draw(img).ellipse([2 + 12 * i, 8, 12 + 12 * i, 20], fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _serve(engine, prompts, images, load_after: int | None):
    feed = PromptFeed(prompts, PARAMS.n, PARAMS.max_new_tokens, images)
    control = StepControl("recompute")
    control.attach(lambda: None)
    count, done, futures = [0], {}, []
    same = {n: p.detach().clone() for n, p in engine.model.state_dict().items()}
    append = engine._append

    def counting(*args):
        count[0] += 1
        if count[0] == load_after:
            futures.append(control.post_load(lambda: engine.load_weights(same, engine.version + 1)))
        return append(*args)

    engine._append = counting
    try:
        engine.serve(feed, PARAMS, 5, lambda i, c: done.__setitem__(i, c), control)
    finally:
        del engine._append
    for f in futures:
        f.result(timeout=1)
    return [done[i] for i in sorted(done)]


def test_recompute_prefill_keeps_the_images():
    path = resolve_model("tiny_vl")
    tok = load_tokenizer(path)
    engine = TorchEngine(load_causal_lm(path), tok, eos_token_ids(tok, path), max_batch_size=8)
    ip = load_image_processor(path)
    records = [
        PromptRecord(0, "shapes", [{"role": "user", "content": "<image>How many?"}], "2", images=[_png(56, 2)]),
        PromptRecord(1, "shapes", [{"role": "user", "content": "Count <image>."}], "3", images=[_png(84, 3)]),
    ]
    enc = encode_prompts(records, tok, 128, image_spec=image_spec(path))
    prompts, images = [p.prompt_ids for p in enc], [pixel_inputs(ip, p.images) for p in enc]
    whole = _serve(engine, prompts, images, None)
    cut = _serve(engine, prompts, images, 5)
    assert engine.version == 1, "the load landed"
    assert max(len(c.response_ids) for c in whole) > 3
    for a, b in zip(whole, cut):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    assert {v for c in cut for v in c.versions} == {0, 1}, "tokens sampled after the load carry version 1"
