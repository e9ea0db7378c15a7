"""A check shared by the engines' agent tests (tests/rollout/test_agent_loop.py, tests/rollout/test_agent_vllm.py):
an engine's ``serve`` continuing a first turn from given token ids."""

from __future__ import annotations

import torch

from offstep.rollout.engines.plain_generation import PromptFeed
from offstep.rollout.types import SamplingParams, TurnRequest


def check_serves_continuation(engine, model, tok, atol: float) -> None:
    """A second turn is a new request whose prompt is the first turn's tokens and more: the engine
    samples it with the log-probs of teacher forcing over the whole sequence, within its own token
    limit; a first turn served through a feed equals plain generation (same random stream)."""
    msgs = [{"role": "system", "content": "calc"}, {"role": "user", "content": "What is 47 * 86?"}]
    prompt = tok(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    plain = engine.generate([prompt], SamplingParams(n=2, temperature=1.0, max_new_tokens=8), seed=3)
    extra = tok("<|im_start|>tool\n4042<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    cont = prompt + plain[0].response_ids + extra

    class Feed(PromptFeed):
        more = [TurnRequest(99, cont, 5 + (1 << 32), 6, 99)]

        def take(self, limit, block):
            out = super().take(limit, block)
            if out is None and self.more:
                out, self.more = self.more, []
            return out

    got = {}
    # Every request fits in the longest first prompt + the call's max_new_tokens (TurnFeed).
    engine.serve(
        Feed([prompt], 2, 8),
        SamplingParams(n=2, temperature=1.0, max_new_tokens=32),
        3,
        lambda i, c: got.__setitem__(i, c),
    )
    assert got[0].response_ids == plain[0].response_ids and got[1].response_ids == plain[1].response_ids
    c = got[99]
    assert 1 <= len(c.response_ids) <= 6
    with torch.no_grad():
        logits = model(torch.tensor([cont + c.response_ids])).logits[0, len(cont) - 1 : -1].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(c.logprobs), want, atol=atol)
