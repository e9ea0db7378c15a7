"""The ``tiny_vl`` alias: a tiny random Qwen2-VL built in code, for tests and smoke runs (nothing is
downloaded). The text tiny model's tokenizer with Qwen2-VL's vision tokens added, a chat template that
renders an ``{"type": "image"}`` part as ``<|vision_start|><|image_pad|><|vision_end|>`` (as Qwen2-VL's
does), a Pillow image processor bounded to 28x28..112x112 pixels (1 to 16 image tokens), and a
2-layer language model with a 2-block vision tower (about 187k parameters)."""

from __future__ import annotations

from pathlib import Path

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

VL_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_vl(out: Path, tok, quiet_transformers) -> None:
    """Build into ``out`` from ``tok`` (the text tiny model's tokenizer, ``offstep.models.builtin``);
    ``quiet_transformers``: the context that silences transformers' logging."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # The call replaces the list of additional special tokens: keep <|im_start|> in it.
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tok.chat_template = VL_CHATML_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<pad>", *VISION_TOKENS)}
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            # mrope sections (temporal, height, width) sum to head_dim / 2 = 16
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            bos_token_id=None,
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<pad>"],
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,  # the merger's output: the text model's hidden size
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    with quiet_transformers():
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    # The text tiny model's explicit init; 1-D parameters: ones for norms, zeros for biases (Qwen2's
    # q/k/v and the vision blocks have biases).
    gen = torch.Generator().manual_seed(20240611)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if param.ndim == 1:
                param.fill_(1.0 if ("norm" in name or "ln_q" in name) else 0.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.3)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"])
    with quiet_transformers():
        model.save_pretrained(out)
        tok.save_pretrained(out)
        image_processor.save_pretrained(out)
