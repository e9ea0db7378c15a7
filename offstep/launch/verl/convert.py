"""verl's values as offstep's: the conversions that the table's ``To`` entries name, where the two
conventions differ (verl's ``-1`` for "never", ``bf16``, ``top_k=-1``), the checks the
derivations share (each takes the verl key, for the message, and the value), and the count of
training rows that verl's epochs are converted through (``training_rows``)."""

from __future__ import annotations

from typing import Any

from offstep.config.schema import Config
from offstep.errors import VerlKeyError

DOC = "docs/from-verl.md"


def fail(key: str, value: Any, why: str) -> VerlKeyError:
    return VerlKeyError(f"verl key {key}={value!r}: {why} ({DOC})")


def never(key: str, v: Any) -> int:
    """verl's frequencies: -1 (or 0) is "never", offstep's 0."""
    return max(0, whole(key, v))


def never_validate(key: str, v: Any) -> int:
    """verl's trainer.test_freq: <= 0 never validates, not even after the last step (verl's trainer
    validates at the end only with test_freq > 0): offstep's -1."""
    n = whole(key, v)
    return n if n > 0 else -1


def whole(key: str, v: Any) -> int:
    """A whole number, as verl's integer fields take."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise fail(key, v, "expected a whole number")
    return int(v)


def target_modules(key: str, v: Any) -> list:
    """verl's default "all-linear" (peft's: every linear layer but the LM head) is, on Llama/Qwen
    models, the seven projections of offstep's default; a list is kept as it is."""
    if v == "all-linear":
        from offstep.config.schema import LoRAConfig

        return list(LoRAConfig().target_modules)
    if isinstance(v, str):
        return [m.strip() for m in v.split(",") if m.strip()]
    return list(v)


def top_k(key: str, v: Any) -> int:
    """verl's -1 (and 0) is "off", offstep's 0."""
    return max(0, whole(key, v))


def dtype(key: str, v: Any) -> str:
    """verl's bf16 and fp32 are offstep's bfloat16 and float32."""
    names = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
    if str(v) not in names:
        raise fail(key, v, "offstep keeps weights in float32 or bfloat16; use bf16 or fp32")
    return names[str(v)]


def zero_if_null(key: str, v: Any) -> Any:
    """verl's null is offstep's 0."""
    return 0 if v is None else v


def function_name(key: str, v: Any) -> str:
    """verl's null function name is its default, compute_score."""
    return "compute_score" if v is None else v


def dict_or_empty(key: str, v: Any) -> dict:
    """verl's null for "no overrides" is offstep's empty dict."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise fail(key, v, "expected a mapping of names to values, e.g. {attention_dropout: 0.0}")
    return v


def files(key: str, v: Any) -> Any:
    """A path where verl takes a string as well as a list (``data.train_files=/data/train.parquet``)."""
    return [v] if isinstance(v, str) else v


def val_max_samples(key: str, v: Any) -> int:
    """verl's -1 ("all") is offstep's 0."""
    return max(0, whole(key, v))


LOGGERS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard"}


def loggers(key: str, v: Any) -> list[str]:
    """verl's loggers, with jsonl added (offstep report reads metrics.jsonl)."""
    names = [v] if isinstance(v, str) else list(v or [])
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise fail(key, v, f"offstep logs to console, jsonl, tensorboard and wandb, not {unknown}; drop them")
    # offstep always writes metrics.jsonl too (offstep report reads it)
    return [*dict.fromkeys(LOGGERS[n] for n in names), "jsonl"]


ESTIMATOR_ALIASES = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}  # verl's vectorised copies


def estimator(key: str, v: Any) -> Any:
    """verl's vectorised copies (grpo_vectorized) are the estimators they copy."""
    if v in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        raise fail(key, v, "offstep has no optimal-token-baseline estimator; use grpo, rloo or opo")
    return ESTIMATOR_ALIASES.get(v, v)


LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo", "gpg": "pg"}


def loss_mode(key: str, v: Any) -> str:
    """verl's vanilla is offstep's ppo, gpg its pg; gspo and cispo keep their names."""
    if v not in LOSS_MODES:
        raise fail(
            key,
            v,
            f"offstep's surrogates are {sorted(LOSS_MODES)} (verl names; offstep's "
            f"algorithm.policy_loss: ppo, gspo, cispo, pg)",
        )
    return LOSS_MODES[v]


def kl_type(key: str, v: Any) -> Any:
    """verl's names (low_var_kl, k1, k2, k3+); the full-vocabulary KL is refused."""
    if v == "full":
        raise fail(key, v, "the full-vocabulary KL is not offered; use low_var_kl (k3), k1, k2 or their + variants")
    return v


def boolean(key: str, v: Any) -> bool:
    """true or false; an empty value (an unset shell variable, ``key=${unset}``) is false, as verl's
    untyped config reads it (``if ''`` is false)."""
    if v == "":
        return False
    if not isinstance(v, bool):
        raise fail(key, v, "expected true or false")
    return v


def at_least_one(key: str, v: Any) -> int:
    """A whole number >= 1, as verl requires."""
    n = whole(key, v)
    if n < 1:
        raise fail(key, v, "must be >= 1, as in verl")
    return n


def training_rows(cfg: Config) -> int:
    """The training prompts of a run: the rows of data.train_files (read here), or
    data.task_train_size for a built-in task."""
    if not cfg.data.train_files:
        return cfg.data.task_train_size
    from offstep.data.dataset import load_records

    return sum(len(load_records(f, cfg.data.prompt_key, cfg.data.answer_key)) for f in cfg.data.train_files)
