"""The vLLM engine serving an agent loop's requests: a continuation is a new request whose prompt
is the first turn's tokens and more (its blocks served from vLLM's prefix cache), sampled with the
log-probs of teacher forcing; a first turn through a feed equals plain generation."""

from __future__ import annotations

import os

import pytest
from agent_helpers import check_serves_continuation
from conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.own_process]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_vllm_serves_continuations_from_given_ids():
    from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
    from offstep.rollout.engines.vllm_engine import VLLMEngine

    path = resolve_model("tiny")
    tok = load_tokenizer(path)
    engine = VLLMEngine(path, tok, eos_token_ids(tok, path), max_batch_size=8, num_threads=1)
    try:
        check_serves_continuation(engine, load_causal_lm(path), tok, atol=1e-3)
    finally:
        engine.close()
