"""Reward scorer lookup: built-in rule scorers by data source, or one user-supplied function.

Scorers use verl's signature ``compute_score(data_source, solution_str, ground_truth,
extra_info=None, **kwargs)`` and return a number, or a dict with a numeric ``"score"`` (other
numeric entries are reported as extra metrics).

Everything a scorer raises, ``SystemExit`` included, becomes a :class:`RewardError` naming the
scorer, the data source and the sample: a ``sys.exit()`` in a scorer must not end (or, in a Ray
worker, silently kill) the process that scores. ``KeyboardInterrupt`` is treated the same off the
main thread, where no Ctrl-C can arrive; in the main thread it is the user's Ctrl-C and propagates.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import math
import numbers
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterable

from offstep.errors import RewardConfigError, RewardError
from offstep.rewards.sources import BUILTIN_SCORERS, builtin_scorer, unscored_sources
from offstep.usercode import finishes_importing, hard_deadline

__all__ = [
    "BUILTIN_SCORERS",
    "RewardFunction",
    "load_custom_scorer",
    "call_with_timeout",
    "CallTimeout",
    "score_of",
    "import_within",
]

Scorer = Callable[..., Any]
SIGNATURE = "(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# custom scorers


def load_custom_scorer(
    path: str,
    name: str = "compute_score",
    timeout_s: float | None = None,
    path_key: str = "reward.custom_path",
    name_key: str = "reward.custom_name",
    timeout_key: str = "reward.timeout_s",
) -> Scorer:
    """Import the Python file at ``path`` and return its function ``name``.

    Raises :class:`RewardConfigError` (a RewardError and a ValueError) if the file is missing,
    fails to import (the original exception is chained and quoted), does not finish importing
    within ``timeout_s`` seconds (None: no limit), or has no callable ``name``. The ``*_key``
    arguments name the settings in messages (``offstep eval`` has flags).
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isfile(path):
        raise RewardConfigError(
            f"custom reward file {path} not found. Fix: set {path_key} to an existing "
            "Python file that defines the scorer."
        )
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    module_name = f"offstep_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardConfigError(
            f"custom reward file {path} cannot be imported as a Python module. Fix: set {path_key} to a .py file."
        )
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module  # lets dataclasses / pickle inside the file resolve
    too_slow = (
        f"{path_key}={path} did not finish importing within {timeout_s or 0:g} s ({timeout_key}): its top-level "
        "code is still running (a sleep, a loop, a download, a lock?). Fix: make importing the file only "
        "define the scorer (move slow set-up into the function, or under `if __name__ == \"__main__\":`), "
        f"or raise {timeout_key}."
    )
    try:
        if timeout_s is None:
            spec.loader.exec_module(module)
        else:  # a file whose top-level code never ends (a sleep, a loop, a download) must not hang the run
            import_within(spec, module, timeout_s, too_slow)
    except BaseException as exc:
        if previous is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = previous
        if isinstance(exc, CallTimeout):
            raise RewardConfigError(too_slow) from None
        if isinstance(exc, SystemExit):  # it would end the run, with exit code 0 for sys.exit(0)
            raise RewardConfigError(
                f"custom reward file {path} called sys.exit({exc.code!r}) while being imported"
                f"{_where(exc, path)}. Fix: put the file's script code under `if __name__ == \"__main__\":` "
                "so that importing it only defines the scorer."
            ) from exc
        if not isinstance(exc, Exception):  # KeyboardInterrupt: the user's Ctrl-C
            raise
        raise RewardConfigError(
            f"custom reward file {path} failed to import: {type(exc).__name__}: {exc}. "
            "Fix: make the file importable on its own (run `python <file>` to see the error)."
        ) from exc

    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        available = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module_name
        )
        what = "has no function" if fn is None else "has a non-callable"
        raise RewardConfigError(
            f"custom reward file {path} {what} {name!r}; its callables are {available}. "
            f"Fix: set {name_key} to one of them, or define {name}(data_source, "
            "solution_str, ground_truth, extra_info=None, **kwargs) in the file."
        )
    return fn


# --------------------------------------------------------------------------------------------------
# timeouts


class CallTimeout(Exception):
    """A call (a scorer's, or the import of a user's file) ran past its time limit."""


_FLOAT32_MAX = 3.4028234663852886e38
_FIX_RESULT = (
    "make the scorer return a finite number, or a dict with a numeric 'score', for every response "
    "(give wrong or malformed answers a low score instead)."
)
_FIX_RAISES = "make the scorer handle every response (give wrong or malformed answers a low score instead of raising)."


def _where(exc: BaseException, prefer: str | None = None) -> str:
    """`` at FILE:LINE`` where ``exc`` was raised: the innermost frame in the file ``prefer`` (the
    user's scorer) if the traceback passes through it, else the innermost frame; empty if unknown."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if found is None or prefer is None or code.co_filename == prefer or found[0] != prefer:
            found = (code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return f" at {found[0]}:{found[1]}" if found else ""


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn()``; raise :class:`CallTimeout` after ``timeout_s`` seconds.

    In the main thread of a Unix process a SIGALRM interval timer interrupts ``fn``. Elsewhere
    (e.g. in a worker thread) ``fn`` runs in a daemon thread that is abandoned on timeout: Python
    cannot stop a thread, so it runs on (holding whatever it holds) until it returns, but being a
    daemon it does not keep the process from exiting.
    """
    use_signal = (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0  # don't clobber someone else's alarm
    )
    if use_signal:

        def _on_alarm(signum, frame):
            raise CallTimeout()

        old_handler = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, old_handler)

    box: dict[str, Any] = {}

    def _target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=_target, name="offstep-reward-scorer", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallTimeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


def import_within(spec, module, timeout_s: float, message: str) -> None:
    """Execute ``module`` within ``timeout_s`` seconds, or raise :class:`CallTimeout`: first in a
    probe process (killed, with what it started, at the limit: a file that ignores SIGALRM or holds
    the interpreter in C cannot switch it off), then here, under the alarm and, should the file hang
    only now, a deadline that prints ``message`` and ends the process."""
    if not finishes_importing(spec.origin, spec.name, timeout_s):
        raise CallTimeout()
    with hard_deadline(timeout_s + max(5.0, timeout_s), message):
        call_with_timeout(lambda: spec.loader.exec_module(module), timeout_s)


def _raised_by_the_call(exc: TypeError) -> bool:
    """Whether ``exc`` was raised by calling the scorer (its arguments do not fit its parameters)
    rather than inside it: its traceback then ends in this module's frame that made the call."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename == __file__ and tb.tb_frame.f_code.co_name == "invoke"


# --------------------------------------------------------------------------------------------------


def _as_float(value: Any) -> float | None:
    """``value`` as a float if it is a real number (bool and numpy scalars included), else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # 0-d numpy arrays / torch tensors, numpy bools
    if callable(item) and getattr(value, "ndim", None) == 0:
        try:
            inner = item()
        except Exception:
            return None
        return float(inner) if isinstance(inner, numbers.Real) else None
    return None


class RewardFunction:
    """Scores one response: the custom scorer if configured, else the built-in for its source.

    Picklable: the custom scorer is imported lazily on first use, in whichever process uses it.
    """

    def __init__(
        self,
        custom_path: str | None = None,
        custom_name: str = "compute_score",
        timeout_s: float | None = None,
        timeout_key: str = "reward.timeout_s",
        path_key: str = "reward.custom_path",
        name_key: str = "reward.custom_name",
        abstain: bool = False,
    ):
        """``timeout_s`` bounds each scorer call and the import of ``custom_path``. The ``*_key``
        arguments name the settings in messages (``offstep eval`` has flags). ``abstain``: a scorer
        may return None, which is passed on (``reward.model.combine=abstain``)."""
        if timeout_s is not None and not float(timeout_s) > 0:
            raise RewardConfigError(
                f"reward timeout must be positive or None, got {timeout_s}. "
                f"Fix: set {timeout_key} to a positive number of seconds (or null)."
            )
        self.custom_path = os.fspath(custom_path) if custom_path else None
        self.custom_name = custom_name
        self.timeout_s = float(timeout_s) if timeout_s is not None else None
        self.timeout_key, self.path_key, self.name_key = timeout_key, path_key, name_key
        self._custom_fn: Scorer | None = None
        self.abstain = abstain

    # pickling: never ship the imported function (its module may not exist on the worker)
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_custom_fn"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"RewardFunction(custom_path={self.custom_path!r}, custom_name={self.custom_name!r}, "
            f"timeout_s={self.timeout_s!r})"
        )

    # ----------------------------------------------------------------------------------------------

    def _custom(self) -> Scorer:
        if self._custom_fn is None:
            self._custom_fn = load_custom_scorer(
                self.custom_path, self.custom_name, self.timeout_s, self.path_key, self.name_key, self.timeout_key
            )
        return self._custom_fn

    def scorer_for(self, data_source: str) -> Scorer:
        """The scorer used for ``data_source``; raises RewardConfigError if there is none."""
        if self.custom_path:
            return self._custom()
        fn = builtin_scorer(data_source)
        if fn is None:
            self.check_sources([data_source])
        return fn

    def _scorer_label(self, fn: Scorer) -> str:
        if self.custom_path:
            return f"custom scorer {self.custom_name!r} in {self.custom_path}"
        return f"built-in scorer {getattr(fn, '__name__', repr(fn))!r}"

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Fail early if some data source has no scorer.

        With a custom scorer every source is accepted (the scorer is imported now, so a bad
        path/name fails here rather than mid-training).
        """
        if self.custom_path:
            self._custom()
            return
        problems = unscored_sources(data_sources, None, self.path_key, self.name_key)
        if problems:
            raise RewardConfigError("; ".join(problems) + ".")

    def check_call(
        self, data_source: str, ground_truth: Any, extra_info: dict | None = None, timeout_s: float = 10.0
    ) -> None:
        """Call the scorer once on a real sample with an empty response, as the rollout workers
        will (``fn(data_source, solution_str, ground_truth, extra_info=extra_info)``), so that a
        scorer with the wrong signature fails before any worker starts rather than after the
        first generation.

        Only arguments that do not fit the scorer's parameters are fatal here. What a scorer does
        with an empty response (raise ValueError, return None, take too long: the dry call waits
        ``timeout_s`` at most) says nothing certain about real responses, which the run checks
        as they come, so those outcomes are only logged."""
        fn = self.scorer_for(data_source)
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read (a builtin): the call below decides
            signature = None
        try:
            if signature is not None:
                signature.bind(data_source, "", ground_truth, extra_info=extra_info)
        except TypeError as exc:
            raise self._wrong_signature(fn, exc, signature) from exc
        try:
            self._score(data_source, "", ground_truth, extra_info, min(timeout_s, self.timeout_s or timeout_s))
        except RewardError as err:
            cause = err.__cause__
            if isinstance(cause, TypeError) and _raised_by_the_call(cause):
                raise self._wrong_signature(fn, cause, signature) from cause
            log.info("dry call of the scorer on an empty response: %s", err)

    def _wrong_signature(self, fn: Scorer, exc: TypeError, signature) -> RewardConfigError:
        name = getattr(fn, "__name__", repr(fn))
        where = self.custom_path or "the built-in scorers"
        has = f"; it is defined as {name}{signature}" if signature is not None else ""
        return RewardConfigError(
            f"the reward function {name!r} in {where} cannot be called the way offstep (like verl) calls "
            f"it, {name}(data_source, solution_str, ground_truth, extra_info=extra_info): {exc}{has}. "
            f"Fix: define it as def {name}{SIGNATURE}."
        )

    # ----------------------------------------------------------------------------------------------

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> tuple[float, dict]:
        """Score one response. Returns ``(score, extras)`` with ``extras`` a dict of floats."""
        return self._score(data_source, solution_str, ground_truth, extra_info, self.timeout_s)

    def _score(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, timeout_s: float | None
    ) -> tuple[float, dict]:
        fn = self.scorer_for(data_source)
        label = self._scorer_label(fn)
        sample = solution_str[:200] if isinstance(solution_str, str) else repr(solution_str)[:200]
        row = extra_info.get("index") if isinstance(extra_info, dict) else None
        which = f"ground truth {repr(ground_truth)[:60]}" + (f", extra_info index {row}" if row is not None else "")

        def fail(problem: str, cause: BaseException | None = None, fix: str = _FIX_RESULT) -> RewardError:
            err = RewardError(
                f"reward for data source {data_source!r} failed: {label} {problem}. "
                f"Sample (first 200 chars): {sample!r} ({which}). Fix: {fix}"
            )
            err.__cause__ = cause
            return err

        def invoke():
            return fn(data_source, solution_str, ground_truth, extra_info=extra_info)

        try:
            if timeout_s is None:
                result = invoke()
            else:
                result = call_with_timeout(invoke, timeout_s)
        except CallTimeout as exc:
            fix = f"make the scorer faster, or raise {self.timeout_key} (null disables the limit)."
            raise fail(f"timed out after {timeout_s:g} s ({self.timeout_key})", exc, fix) from exc
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise  # the user's Ctrl-C (see the module docstring)
            what = f"raised {type(exc).__name__}" + (f": {exc}" if str(exc) else "")
            if isinstance(exc, SystemExit):
                what = f"called sys.exit({exc.code!r})"
            raise fail(f"{what}{_where(exc, self.custom_path)}", exc, _FIX_RAISES) from exc

        try:
            return score_of(result, abstain=getattr(self, "abstain", False))
        except ValueError as exc:
            raise fail(str(exc)) from None


def score_of(result: Any, abstain: bool = False) -> tuple[float | None, dict]:
    """A scorer's return value (a number, or a dict with a numeric ``"score"``) as ``(score,
    extras)``; raises ValueError saying what is wrong with it (``returned ...``). ``abstain``: a
    None score is the scorer abstaining (``reward.model.combine=abstain``), returned as None."""
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without a 'score' key (keys: {sorted(map(str, result))})")
        raw = result["score"]
        for key, value in result.items():
            if key == "score":
                continue
            as_float = _as_float(value)
            if as_float is not None:
                extras[str(key)] = as_float
    else:
        raw = result
    if raw is None and abstain:
        return None, extras
    score = _as_float(raw)
    if score is None:
        raise ValueError(f"returned a non-number {type(raw).__name__} {repr(raw)[:80]}")
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    if abs(score) > _FLOAT32_MAX:  # the batch holds scores as float32: this would become inf
        raise ValueError(f"returned {score:g}, beyond float32's range (|score| <= {_FLOAT32_MAX:.4g})")
    return score, extras
