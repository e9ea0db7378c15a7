"""A bound on how old a sample's KV cache may be (``rollout.max_kv_age``) and the shared prompt
prefix keyed by weight version, on the built-in engine (``offstep.rollout.engines.schedule``).

A hand-built schedule: samples admitted at versions 0 and 1, loads of versions 1, 2 and 3 posted
from the engine's own thread at fixed token counts (deterministic). Then:
- ``max_kv_age=0`` gives what ``partial=recompute`` gives, token for token and log-prob for log-prob;
- a large bound gives what ``keep`` gives;
- in between, the samples prefilled again at each load are exactly those whose K/V would lag the
  new weights by more than the bound (replayed from each sample's versions), each sample's
  ``kv_age`` is the most its K/V lagged, and never more than the bound;
- a sample admitted after a load never reads the shared prompt prefix computed by the weights
  before it (the prefix is keyed by version: dropping the key makes this test fail).
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine import _random_lm, prompts, tiny, tok  # noqa: F401 (fixtures)
from test_partial_rollout import _teacher_under, _weights

from offstep.rollout.engines import schedule
from offstep.rollout.engines.control import StepControl
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.stream.replica_stream import StreamFeed
from offstep.rollout.types import SamplingParams, TurnRequest

pytestmark = pytest.mark.heavy

PARAMS = SamplingParams(n=1, temperature=1.0, max_new_tokens=40)
TOL = 2e-4
LOADS = {4: 1, 20: 2, 45: 3}  # tokens appended (over all samples) -> the version posted then
LATER_AT = 12  # tokens appended when the second wave of requests is queued (admitted under version 1)


@pytest.fixture(params=["slots", "hf"])
def setup(request, tok):  # noqa: F811 (a fixture)
    kind = "qwen2" if request.param == "slots" else "qwen3"
    model = _random_lm(kind, len(tok))
    weights = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    weights += [_weights(model, seed) for seed in (1, 2, 3)]
    engine = TorchEngine(model, tok, [10_000_000 % len(tok)], runner=request.param)
    assert engine.runner == request.param
    yield engine, model, weights


def _serve(engine, weights, first, later, control):
    """Serve ``first`` at version 0, queue ``later`` after LATER_AT tokens, post the loads of LOADS.
    Returns ({index: completion}, [(version, indices of the rows prefilled again)])."""
    engine.load_weights(weights[0], 0)
    feed = StreamFeed([r.prompt_ids for r in first + later], 8)
    control.attach(feed.wake)
    done, count, recomputed, futures = {}, [0], [], []
    append, stale_rows = engine._append, schedule.stale_rows

    def counting(*args):
        count[0] += 1
        if count[0] in LOADS:
            v = LOADS[count[0]]
            futures.append(control.post_load(lambda: engine.load_weights(weights[v], v)))
        if count[0] == LATER_AT:
            feed.put(list(later))
        return append(*args)

    def spying(rows, version, ctl):
        out = stale_rows(rows, version, ctl)
        recomputed.append((version, sorted(rows[j].index for j in out)))
        return out

    def on_finish(i, c):
        done[i] = c
        if len(done) == len(first) + len(later):
            feed.close()

    engine._append = counting
    schedule.stale_rows = spying
    try:
        feed.put(list(first))
        t = threading.Thread(target=engine.serve, args=(feed, PARAMS, 5, on_finish, control), daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive()
    finally:
        del engine._append
        schedule.stale_rows = stale_rows
    for f in futures:
        f.result(timeout=1)
    return done, recomputed


def _requests(prompts, first=0):  # noqa: F811
    return [TurnRequest(first + i, p, first + i, PARAMS.max_new_tokens, first + i) for i, p in enumerate(prompts)]


def _waves(prompts):  # noqa: F811
    return _requests(prompts[:2]), _requests(prompts[2:], first=2)


def _same(a, b):
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].response_ids == b[i].response_ids and a[i].versions == b[i].versions, i
        assert torch.allclose(torch.tensor(a[i].logprobs), torch.tensor(b[i].logprobs), atol=1e-6), i


def test_bound_zero_is_recompute_and_a_large_bound_is_keep(setup, prompts):  # noqa: F811
    engine, _, weights = setup
    first, later = _waves(prompts)
    recompute, _ = _serve(engine, weights, first, later, StepControl("recompute"))
    zero, _ = _serve(engine, weights, first, later, StepControl("keep", max_kv_age=0))
    _same(zero, recompute)
    keep, _ = _serve(engine, weights, first, later, StepControl("keep"))
    large, rec = _serve(engine, weights, first, later, StepControl("keep", max_kv_age=100))
    _same(large, keep)
    assert all(not rows for _, rows in rec)
    assert any(c.extra["kv_age"] > 0 for c in keep.values())


@pytest.mark.parametrize("bound", [1, 2])
def test_exactly_the_samples_past_the_bound_are_prefilled_again(setup, prompts, bound):  # noqa: F811
    engine, model, weights = setup
    first, later = _waves(prompts)
    done, recomputed = _serve(engine, weights, first, later, StepControl("keep", max_kv_age=bound))
    assert [v for v, _ in recomputed] == [1, 2, 3]
    # Replay each sample's K/V version from its token versions: admitted at its first token's
    # version; at each load it ran across, prefilled again when the new version is past the bound.
    kv = {i: c.versions[0] for i, c in done.items()}
    age = dict.fromkeys(done, 0)
    for version, rows in recomputed:
        running = [i for i, c in done.items() if min(c.versions) < version <= max(c.versions)]
        want = sorted(i for i in running if version - kv[i] > bound)
        assert rows == want, (version, rows, want)
        for i in running:
            if i in want:
                kv[i] = version
            else:
                age[i] = max(age[i], version - kv[i])
    assert any(rows for _, rows in recomputed), "the schedule must exercise the bound"
    assert {i: c.extra["kv_age"] for i, c in done.items()} == age
    assert max(age.values()) <= bound
    # A sample prefilled again at load v decodes from then on under v exactly.
    for version, rows in recomputed:
        for i in rows:
            c = done[i]
            cut, end = c.versions.index(version), (c.versions.index(version + 1) if version + 1 in c.versions else None)
            want = _teacher_under(model, weights[version], prompts[i], c.response_ids)
            got = torch.tensor(c.logprobs)
            assert torch.allclose(got[cut:end], want[cut:end], atol=TOL), (i, version)


def test_shared_prefix_is_never_reused_across_versions(tok, prompts):  # noqa: F811 (fixtures)
    """Samples admitted after a load copy the shared prompt prefix's K/V: it must be the new
    weights'. Their log-probs equal the new weights' teacher-forced ones exactly (the load posted
    with keep and no bound, so nothing else recomputes anything)."""
    model = _random_lm("qwen2", len(tok))
    weights = [{n: p.detach().clone() for n, p in model.named_parameters()}] + [_weights(model, s) for s in (1, 2, 3)]
    engine = TorchEngine(model, tok, [10_000_000 % len(tok)], runner="slots")
    prompts = [list(range(100, 116)) + p for p in prompts]  # a system prompt every prompt starts with
    assert schedule.shared_prefix(prompts) >= engine.min_shared_prefix
    first, later = _waves(prompts)
    done, _ = _serve(engine, weights, first, later, StepControl("keep"))
    for i in range(2, len(prompts)):  # the second wave: admitted under version 1 (its first token's)
        c = done[i]
        v = c.versions[0]
        assert v >= 1
        end = c.versions.index(v + 1) if v + 1 in c.versions else None
        want = _teacher_under(model, weights[v], prompts[i], c.response_ids)
        assert torch.allclose(torch.tensor(c.logprobs)[:end], want[:end], atol=TOL), i
