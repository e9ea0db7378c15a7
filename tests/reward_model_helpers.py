"""Tiny reward models built in code for the reward-model tests: sequence-classification heads of
two architectures (Llama, Qwen2) with the tiny model's tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import torch


def build_classifier(folder: Path, arch: str, tok, seed: int = 0) -> Path:
    """A random one-label ``{arch}ForSequenceClassification`` saved (safetensors) with ``tok``."""
    from transformers import LlamaConfig, LlamaForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

    common = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForSequenceClassification),
        "qwen2": (Qwen2Config, Qwen2ForSequenceClassification),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).eval()
    with torch.no_grad():  # a head of visible size, so that different chats score clearly apart
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
