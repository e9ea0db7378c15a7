"""``StepControl`` (``offstep.rollout.engines.control``) on its own: what a serving engine carries out
at its step boundary, posted by other threads."""

from __future__ import annotations

from offstep.rollout.engines.control import StepControl


def test_a_load_posted_while_another_waits_runs_after_it_at_the_same_boundary():
    """The engine's thread can be busy past a training step (a reference pass over a group of long
    samples took 19 s on SmolLM2 with 1024-token answers, the step 14 s): the next step's load then
    arrives while the last one still waits. It used to raise ("a weight load is already waiting"),
    which ended the run; both now run, in the order posted, each poster told when its own ran."""
    control, woken, applied = StepControl("keep"), [], []
    control.attach(lambda: woken.append(1))
    first = control.post_load(lambda: applied.append(1))
    second = control.post_load(lambda: applied.append(2))
    assert len(woken) == 2 and applied == [] and not first.done() and not second.done()
    assert control.pending() == "load"
    assert control.run_load() is True  # the engine's next step boundary
    assert applied == [1, 2] and first.result(0) is None and second.result(0) is None
    assert control.pending() is None and control.run_load() is False


def test_a_failed_load_is_its_posters_error_and_the_next_still_runs():
    control, applied = StepControl("recompute"), []
    control.attach(lambda: None)

    def bad():
        raise ValueError("the weights do not match the model")

    failed, later = control.post_load(bad), control.post_load(lambda: applied.append(2))
    control.run_load()
    assert isinstance(failed.exception(0), ValueError) and later.result(0) is None and applied == [2]


def test_posted_loads_run_at_once_when_no_engine_serves():
    control, applied = StepControl("keep"), []
    assert control.post_load(lambda: applied.append(1)).result(0) is None
    control.attach(lambda: None)
    pending = control.post_load(lambda: applied.append(2))
    control.detach()  # the engine stopped: what is still posted runs now
    assert pending.result(0) is None and applied == [1, 2]
