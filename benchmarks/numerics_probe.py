"""What makes two installs' default runs differ? Fingerprints of each step from the GGUF file to the
first sampled token, for the packages and CPU this process runs with.

    .venv/bin/python -m benchmarks.numerics_probe --save /tmp/a.pt
    pip install --no-deps --target /tmp/tf transformers==5.24.0
    PYTHONPATH=/tmp/tf .venv/bin/python -m benchmarks.numerics_probe --save /tmp/b.pt   # another version
    ATEN_CPU_CAPABILITY=default .venv/bin/python -m benchmarks.numerics_probe --save /tmp/c.pt  # another CPU ISA
    .venv/bin/python -m benchmarks.numerics_probe --compare /tmp/a.pt /tmp/b.pt

Prints one JSON line: the hash of the de-quantised weights (a fresh conversion in a temporary
folder), of the prompts' token ids, of float32 logits and of greedy continuations; ``--compare``
prints the largest logit difference between two saved runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def probe(save: str | None) -> dict:
    import torch
    import transformers
    from safetensors.torch import load_file

    from offstep.models.builtin import _build_smollm2
    from offstep.models.loading import load_causal_lm, load_tokenizer

    torch.set_num_threads(1)
    out = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    folder = Path(tempfile.mkdtemp()) / "smollm2"
    _build_smollm2(folder)
    state = load_file(folder / "model.safetensors")
    out["weights"] = _sha(
        b"".join(k.encode() + state[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(state))
    )
    tok = load_tokenizer(folder)
    questions = [f"What is {a} + {b}? Answer with a number." for a, b in [(12, 30), (7, 95), (41, 41), (3, 8)]]
    ids = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in questions
    ]
    out["token_ids"] = _sha(json.dumps(ids).encode())
    model = load_causal_lm(folder, torch.float32).eval()
    width = max(map(len, ids))
    pad = tok.pad_token_id
    x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=mask).logits
        greedy = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=pad)
    out["logits"] = _sha(logits.numpy().tobytes())
    out["greedy"] = _sha(greedy.numpy().tobytes())
    if save:
        torch.save(logits, save)
    return out


def compare(a: str, b: str) -> dict:
    import torch

    x, y = torch.load(a), torch.load(b)
    return {
        "equal": bool(torch.equal(x, y)),
        "max_abs_diff": float((x - y).abs().max()),
        "same_argmax": float((x.argmax(-1) == y.argmax(-1)).float().mean()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", help="write the logits here, for --compare")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args()
    print(json.dumps(compare(*args.compare) if args.compare else probe(args.save)))


if __name__ == "__main__":
    main()
