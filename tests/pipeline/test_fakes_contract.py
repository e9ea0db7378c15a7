"""The simulated workers (``tests/fakes.py``) take every argument the real ones take.

The pipeline calls a worker by its real signature; a fake left behind when a real method gains a
parameter fails every simulated run with a TypeError from inside Ray, far from the cause (delta
syncs and the KV age bound did this twice). This test names the method and the missing parameter."""

import inspect

import pytest

from offstep.rollout.worker import RolloutWorker
from offstep.train.actor import ActorWorker
from tests.fakes import FakeActor, FakeRollout


def _params(fn) -> dict[str, inspect.Parameter]:
    # Ray's tracing adds ``_ray_trace_ctx`` to a class's methods in place once it is made remote,
    # so the real classes carry it after any Ray test ran in this process; it is Ray's, not ours.
    return {n: p for n, p in inspect.signature(fn).parameters.items() if n != "self" and not n.startswith("_ray_")}


@pytest.mark.parametrize(
    "fake,real", [(FakeRollout, RolloutWorker), (FakeActor, ActorWorker)], ids=["rollout", "actor"]
)
def test_each_fake_method_takes_the_real_arguments(fake, real):
    checked = 0
    for name, fn in vars(fake).items():
        if name.startswith("_") or not callable(fn) or not hasattr(real, name) or name == "reset":
            continue
        mine, theirs = _params(fn), _params(getattr(real, name))
        order = [
            n
            for n in theirs
            if theirs[n].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        assert [n for n in mine if n in order] == order, (
            f"{fake.__name__}.{name}: parameters {list(mine)}, the real {real.__name__}.{name} takes {list(theirs)}"
        )
        for n, p in theirs.items():
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                continue
            assert n in mine, f"{fake.__name__}.{name} lacks the parameter {n!r} of {real.__name__}.{name}"
            if p.default is not inspect.Parameter.empty:
                assert mine[n].default is not inspect.Parameter.empty, (
                    f"{fake.__name__}.{name}: {n!r} needs a default, as in {real.__name__}.{name}"
                )
        checked += 1
    assert checked >= 5, f"only {checked} methods of {fake.__name__} compared: are the real classes renamed?"
