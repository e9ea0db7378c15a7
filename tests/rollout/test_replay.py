"""Replaying a fully asynchronous run from its recorded schedule (``offstep.rollout.engines.replica_schedule``,
``offstep.pipeline.replay``, ``pipeline.replay``).

- The schedule's rules by hand: what is due before which decode step, and what may run.
- On the built-in engine, both forward paths: a serve records where a weight load landed (inside
  the samples) and when later requests were admitted; a replay of that schedule, with the load and
  the requests posted at other times (all before the first step; or long after the step they are
  due at), gives every sample the same tokens, log-probs and versions.
- Through Ray on the tiny preset with k = 1: a run in which loads land inside samples (partial
  rollouts), replayed, writes the same records step for step (everything but wall-clock figures:
  losses, rewards, entropy, staleness, version spans, partial samples) and the same samples. The
  vLLM engine likewise (slow).
- What cannot be replayed is refused before start, naming the key and the fix.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from conftest import needs_vllm
from run_records import step_records
from test_engine import _random_lm, prompts, tiny, tok  # noqa: F401 (fixtures)
from test_partial_rollout import LOAD_AT, PARAMS, _requests, _weights

from offstep.launch.loader import load_config
from offstep.launch.preflight import environment_problems
from offstep.launch.validate import problems
from offstep.pipeline.replay import read_schedule
from offstep.rollout.engines.control import StepControl
from offstep.rollout.engines.replica_schedule import ADMIT, LOAD, UNTIL, Schedule
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.stream.replica_stream import StreamFeed
from offstep.telemetry.metrics import read_jsonl


# ---------------------------------------------------------------- the schedule's rules
def test_what_is_due_and_what_may_run():
    s = Schedule([[0, ADMIT, [[1, 0, 0, 5]]], [3, LOAD], [3, ADMIT, [[1, 1, 0, 5]]]])
    assert s.replaying and s.due() == [0, ADMIT, [[1, 0, 0, 5]]]
    assert not s.allows(LOAD) and s.allows(ADMIT)
    s.note(ADMIT)
    assert s.due() is None and not s.allows(LOAD)  # the load is due before step 3, not 0
    for _ in range(3):
        s.decoded()
    assert s.due() == [3, LOAD] and s.allows(LOAD) and not s.allows(ADMIT)
    s.note(LOAD)
    s.decoded()  # step 3 ran without the admission due before it: the replay no longer follows the record
    with pytest.raises(RuntimeError, match="differs from the recorded one"):
        s.due()


def test_a_recording_schedule_allows_everything_and_keeps_the_order():
    s = Schedule()
    assert not s.replaying and s.allows(LOAD) and s.due() is None
    s.note(ADMIT, [[1, 0, 0, 5]])
    s.decoded()
    s.decoded()
    s.note(LOAD)
    assert s.drain() == [[0, ADMIT, [[1, 0, 0, 5]]], [2, LOAD], [2, UNTIL]]
    assert s.drain() == [[2, UNTIL]]


def test_nothing_unrecorded_runs_before_the_last_mark():
    """A replay that ran out of events at step 1 still holds a load until step 4, the step the
    recorded replica had reached when its events were collected; then it runs freely."""
    s = Schedule([[0, ADMIT, [[1, 0, 0, 5]]], [1, UNTIL], [1, LOAD], [4, UNTIL]])
    s.note(ADMIT, [[1, 0, 0, 5]])
    s.decoded()
    assert s.due() == [1, LOAD] and s.allows(LOAD)  # the first mark is passed on the way
    s.note(LOAD)
    for t in (1, 2, 3):
        assert s.replaying and s.due() is None and not s.allows(LOAD) and not s.allows(ADMIT), t
        s.decoded()
    assert s.due() is None and not s.replaying and s.allows(LOAD) and s.allows(ADMIT)
    # a replay records what it does, so a replayed run's schedule is the recorded one
    assert s.drain() == [[0, ADMIT, [[1, 0, 0, 5]]], [1, LOAD], [4, UNTIL]]


def test_an_idle_replica_that_cannot_reach_the_next_event_says_so():
    feed = StreamFeed([], 4, schedule=Schedule([[0, ADMIT, [[1, 0, 0, 5]]], [3, LOAD]]))
    feed.schedule.note(ADMIT)
    with pytest.raises(RuntimeError, match=r"nothing in flight at decode step 0.*\[3, 'load'\]"):
        feed.take(4, block=True)
    assert feed.take(4, block=False) == []  # with samples in flight it decodes on towards step 3


# ---------------------------------------------------------------- one engine, posts at other times
def _serve(engine, first, later, schedule: Schedule, post: str, new):
    """Serve ``first`` then ``later`` requests with a load of ``new`` weights. ``post="inside"``:
    the load and ``later`` are posted from the engine's thread after ``LOAD_AT`` tokens (the
    recorded run); ``"early"``: both before the engine starts; ``"late"``: from another thread, well
    after the engine reached the step they are due at; ``"none"``: ``later`` before the engine starts,
    no load. Returns {index: completion}."""
    feed = StreamFeed([r.prompt_ids for r in first + later], 8, schedule=schedule)
    control = StepControl("recompute")
    feed.while_waiting = control.run_posted
    control.use_schedule(schedule, feed)
    control.attach(feed.wake)
    done, count, futures = {}, [0], []
    append = engine._append

    def load():
        futures.append(control.post_load(lambda: engine.load_weights(new, 1)))
        feed.put(list(later))

    def counting(*args):
        count[0] += 1
        if post == "inside" and count[0] == LOAD_AT:
            load()
        return append(*args)

    def on_finish(i, c):
        done[i] = c
        if len(done) == len(first) + len(later):
            feed.close()

    engine._append = counting
    feed.put(first)
    if post == "early":
        load()
    if post == "none":
        feed.put(list(later))
    t = threading.Thread(target=engine.serve, args=(feed, PARAMS, 5, on_finish, control), daemon=True)
    t.start()
    if post == "late":
        time.sleep(1.0)
        threading.Thread(target=load, daemon=True).start()
    t.join(60)
    del engine._append
    assert not t.is_alive()
    for f in futures:
        f.result(timeout=1)
    return done


@pytest.mark.heavy
@pytest.mark.parametrize("runner,kind", [("slots", "qwen2"), ("hf", "qwen3")])
def test_a_replayed_serve_repeats_the_recorded_one(tok, prompts, runner, kind):  # noqa: F811 (fixtures)
    model = _random_lm(kind, len(tok))
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = _weights(model, 1)
    engine = TorchEngine(model, tok, [10_000_000 % len(tok)], runner=runner)  # an eos no sample meets early
    first, later = _requests(prompts[:3]), _requests(prompts[3:], first=3)
    recorder = Schedule()
    recorded = _serve(engine, first, later, recorder, "inside", new)
    events = recorder.drain()
    assert [e[1] for e in events].count(LOAD) == 1 and 0 < [e for e in events if e[1] == LOAD][0][0]
    assert any(0 < c.versions.count(1) < len(c.versions) for c in recorded.values()), "a sample crossed the load"
    for post in ("early", "late"):
        engine.load_weights(old, 0)
        replayed = _serve(engine, first, later, Schedule(events), post, new)
        for i, c in recorded.items():
            r = replayed[i]
            assert (r.response_ids, r.versions) == (c.response_ids, c.versions), (post, i)
            assert torch.equal(torch.tensor(r.logprobs), torch.tensor(c.logprobs)), (post, i)
        if post == "early":  # the same posts without the schedule: the load lands before the first step
            engine.load_weights(old, 0)
            free = _serve(engine, first, later, Schedule(), post, new)
            assert all(set(c.versions) == {1} for c in free.values())


@pytest.mark.heavy
def test_a_load_after_the_last_recorded_event_waits_for_the_steps_the_record_covers(tok, prompts):  # noqa: F811
    """The recorded serve had no load: replayed with a load posted before the first step, the load
    waits until the recorded decode steps are done, and every sample is as recorded (version 0)."""
    model = _random_lm("qwen2", len(tok))
    new = _weights(model, 1)
    engine = TorchEngine(model, tok, [10_000_000 % len(tok)], runner="slots")
    first, later = _requests(prompts[:3]), _requests(prompts[3:], first=3)
    recorder = Schedule()
    recorded = _serve(engine, first, later, recorder, "none", new)
    events = recorder.drain()
    assert [e[1] for e in events] == [ADMIT, UNTIL] and events[-1][0] > 1
    replayed = _serve(engine, first, later, Schedule(events), "early", new)
    assert engine.version == 1  # the load did run, after the samples
    for i, c in recorded.items():
        assert set(c.versions) == {0}
        assert (replayed[i].response_ids, replayed[i].versions) == (c.response_ids, c.versions), i
        assert torch.equal(torch.tensor(replayed[i].logprobs), torch.tensor(c.logprobs)), i


# ---------------------------------------------------------------- a whole run through Ray
def _cfg(out, engine: str, *extra: str):
    return load_config(
        [
            "preset=tiny",
            "pipeline.mode=fully_async",
            "pipeline.max_staleness=1",
            "trainer.total_steps=4",
            f"trainer.output_dir={out}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
            "rollout.n=4",
            "rollout.max_new_tokens=128",
            f"rollout.engine={engine}",
            *extra,
        ]
    )


def _samples(run) -> list:
    return [(s["step"], s["version"], s["response"], s["reward"]) for s in read_jsonl(run / "samples.jsonl")]


@pytest.mark.ray
@pytest.mark.parametrize("engine", ["builtin", pytest.param("vllm", marks=[needs_vllm, pytest.mark.slow])])
def test_a_replayed_run_reproduces_the_recorded_one(tmp_path, ray_session, engine):
    from offstep.pipeline.controller import train

    replayed = tmp_path / "replayed"
    # The point of a replay: loads landed inside samples, where they land depends on timing. Whether
    # one does at all depends on it too (an update that takes longer than the generation of the next
    # groups loads between samples): up to three recorded runs for one that has partial rollouts.
    for attempt in range(3):
        recorded = tmp_path / f"recorded{attempt}"
        train(_cfg(recorded, engine))
        first = step_records(recorded)
        if max(m["rollout/version_span_max"] for m in first.values()) == 2:
            break
    else:
        pytest.fail(f"no load landed inside a sample in three recorded runs: {first}")
    train(_cfg(replayed, engine, f"pipeline.replay={recorded}"))
    again = step_records(replayed)
    assert sorted(again) == sorted(first)
    for step in first:
        assert again[step] == first[step], {
            k: (first[step][k], again[step].get(k)) for k in first[step] if first[step][k] != again[step].get(k)
        }
    assert _samples(replayed) == _samples(recorded)
    # The replayed run records its own schedule: the recorded one, but for where its collections fell.
    # Its last collection may come before or after events due after the last step's samples, so the
    # two agree as far as both go; both go past the load of version 2, which step 4's samples
    # (staleness at most 1) were all sampled after.
    assert read_schedule(str(replayed)).steps == read_schedule(str(recorded)).steps
    for mine, theirs in zip(read_schedule(str(replayed)).events, read_schedule(str(recorded)).events):
        mine, theirs = ([e for e in events if e[1] != UNTIL] for events in (mine, theirs))
        n = min(len(mine), len(theirs))
        assert mine[:n] == theirs[:n] and [e[1] for e in mine[:n]].count(LOAD) >= 2


# ---------------------------------------------------------------- refused before start
def test_what_cannot_be_replayed_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    msgs = problems(load_config(["preset=tiny", f"pipeline.replay={run}"]))
    assert any("pipeline.mode=fully_async, or pipeline.replay=''" in m for m in msgs), msgs

    def env(*extra):
        return environment_problems(
            load_config(
                [
                    "preset=tiny",
                    "pipeline.mode=fully_async",
                    f"pipeline.replay={run}",
                    f"trainer.output_dir={tmp_path / 'out'}",
                    *extra,
                ]
            )
        )

    assert any("no schedule.jsonl there" in m for m in env())
    cfg = load_config(["preset=tiny", "pipeline.mode=fully_async", f"trainer.output_dir={run}"])
    from offstep.config.schema import to_yaml

    (run / "config.yaml").write_text(to_yaml(cfg))
    start = {"step": 0, "start": True, "replicas": 1, "batch": 4}
    (run / "schedule.jsonl").write_text(
        json.dumps(start) + "\n" + json.dumps({"step": 1, "groups": [0, 1, 2, 3], "events": [[]]}) + "\n"
    )
    assert env() == []
    assert any("rollout.n=2 there, 4 here" in m and "its config.yaml" in m for m in env("rollout.n=4"))
    assert any(
        "this run's own trainer.output_dir" in m
        for m in environment_problems(
            load_config(
                ["preset=tiny", "pipeline.mode=fully_async", f"pipeline.replay={run}", f"trainer.output_dir={run}"]
            )
        )
    )
    good = (run / "schedule.jsonl").read_text()
    (run / "schedule.jsonl").write_text(json.dumps(start) + "\n" + json.dumps({"step": 1, "events": [[]]}) + "\n")
    assert any("is not a schedule an offstep run wrote (KeyError: 'groups')" in m for m in env())
    (run / "schedule.jsonl").write_text(
        json.dumps(start) + "\n" + json.dumps({"step": 1, "groups": [0, 1, 2, 3], "events": [[[0, "jump"]]]}) + "\n"
    )
    assert any(
        "step 1 has events of kinds ['jump'], not one of ['admit', 'load', 'suspend', 'until']" in m for m in env()
    )
    (run / "schedule.jsonl").write_text(good)
    with (run / "schedule.jsonl").open("a") as f:  # a resumed run: the stream started twice
        f.write(json.dumps({**start, "step": 1}) + "\n")
    assert any("only an uninterrupted run can be replayed" in m for m in env())
