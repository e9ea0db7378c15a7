"""A tiny Llama built in code whose greedy continuation of each token is scripted: with every
attention and MLP output zeroed, the last hidden state is the last token's embedding, so the
logits depend on the last token only, and ``CHAIN`` says which token comes next. After the chat
template's assistant header ("\\n") it writes ``<x>5 </x>``: a call of the tool ``x`` in the
``tag`` format. Other tokens continue at random."""

from __future__ import annotations

import torch

# tiny tokenizer ids: "\n" -> "<" -> "x" -> ">" -> "5" -> " <" -> "/" -> "x" (-> ">": the stop string </x> ends it)
CHAIN = {201: 30, 30: 90, 90: 32, 32: 23, 23: 456, 456: 17, 17: 90}
CALL_TEXT = "<x>5 </x>"
X_TOOL = {
    "type": "function",
    "function": {
        "name": "x",
        "description": "x of an expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def scripted_model(path: str, sharpness: float = 1.0):
    """The model (float32, tokenizer of ``path``'s vocabulary); ``sharpness`` scales the scripted
    logits (1.0: the scripted token has about 0.85 of the probability)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.normal_(0, 0.02)
        head.normal_(0, 0.02)
        for k, (tok, nxt) in enumerate(CHAIN.items()):
            emb[tok] = 0.0
            emb[tok, k] = 1.0
            head[nxt, k] = sharpness
    return model.eval()
