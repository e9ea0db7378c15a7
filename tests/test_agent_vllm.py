"""The vLLM engine serving an agent loop's requests: a continuation is a new request whose prompt
is the first turn's tokens and more (served from vLLM's prefix cache), sampled with the log-probs
of teacher forcing; a first turn through a feed equals plain generation."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import needs_vllm

from offstep.rollout.types import PromptFeed, SamplingParams, TurnRequest

pytestmark = needs_vllm
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_vllm_serves_continuations_from_given_ids():
    from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
    from offstep.rollout.vllm_engine import VLLMEngine

    path = resolve_model("tiny")
    tok = load_tokenizer(path)
    engine = VLLMEngine(path, tok, eos_token_ids(tok, path), max_batch_size=8, num_threads=1)
    try:
        msgs = [{"role": "user", "content": "What is 47 * 86?"}]
        prompt = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
        plain = engine.generate([prompt], SamplingParams(n=2, temperature=1.0, max_new_tokens=8), seed=3)
        cont = prompt + plain[0].response_ids + tok("<|im_start|>tool\n4042<|im_end|>\n<|im_start|>assistant\n",
                                                    add_special_tokens=False).input_ids

        class Feed(PromptFeed):
            more = [TurnRequest(99, cont, 5 + (1 << 32), 6, 99)]

            def take(self, limit, block):
                out = super().take(limit, block)
                if out is None and self.more:
                    out, self.more = self.more, []
                return out

        got = {}
        engine.serve(Feed([prompt], 2, 8), SamplingParams(n=2, temperature=1.0, max_new_tokens=32), 3,
                     lambda i, c: got.__setitem__(i, c))
        assert got[0].response_ids == plain[0].response_ids and got[1].response_ids == plain[1].response_ids
        c = got[99]
        assert 1 <= len(c.response_ids) <= 6
        model = load_causal_lm(path)
        with torch.no_grad():
            logits = model(torch.tensor([cont + c.response_ids])).logits[0, len(cont) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-3)
    finally:
        engine.close()
