"""Partial rollouts on the built-in engine (``offstep.rollout.control``): a weight load posted while
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
"""

from __future__ import annotations

import threading

import pytest
import torch

from test_engine import _random_lm, prompts, tiny, tok  # noqa: F401 (fixtures)

from offstep.rollout.control import SUSPENDED, StepControl
from offstep.rollout.engine import TorchEngine
from offstep.rollout.stream import StreamFeed
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


def _serve(engine: TorchEngine, requests, control: StepControl, post_after: int | None, action: str):
    """Serve ``requests``; after ``post_after`` tokens in all, post ``action`` (from the engine's own
    thread, inside ``_append``: deterministic). Returns {index: completion}."""
    feed = StreamFeed([r.prompt_ids for r in requests], 8)
    control.attach(feed.wake)
    done, count = {}, [0]
    append = engine._append

    def counting_append(row, token, lp, params, window):
        count[0] += 1
        if post_after is not None and count[0] == post_after:
            futures.append(control.post_load(lambda: engine.load_weights(new, 1)) if action == "load" else control.post_suspend())
        return append(row, token, lp, params, window)

    futures: list = []
    new = engine._test_new_weights
    engine._append = counting_append

    def on_finish(i, c):
        done[i] = c
        if len(done) == len(requests):
            feed.close()

    feed.put(requests)
    t = threading.Thread(target=engine.serve, args=(feed, PARAMS, 5, on_finish, control))
    t.start()
    t.join(60)
    assert not t.is_alive()
    del engine._append
    for f in futures:
        f.result(timeout=1)
    return done


def _requests(prompts):
    return [TurnRequest(i, p, i, PARAMS.max_new_tokens, i) for i, p in enumerate(prompts)]


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


@pytest.mark.parametrize("partial", ["recompute", "keep", "off"])
def test_a_load_lands_between_decode_steps(setup, prompts, partial):  # noqa: F811 (a fixture)
    engine, model, old, new = setup
    engine.load_weights(old, 0)
    done = _serve(engine, _requests(prompts), StepControl(partial), LOAD_AT, "load")
    assert engine.version == 1
    crossed = 0
    worst_keep = 0.0
    for i, p in enumerate(prompts):
        c = done[i]
        vs = c.versions
        assert len(vs) == len(c.response_ids) == len(c.logprobs) and vs == sorted(vs) and set(vs) <= {0, 1}
        cut = vs.index(1) if 1 in vs else len(vs)
        lp = torch.tensor(c.logprobs)
        before = _teacher_under(model, old, p, c.response_ids)[:cut]
        assert torch.allclose(lp[:cut], before, atol=TOL), "tokens before the load: the old weights' log-probs"
        if 0 < cut < len(vs):
            crossed += 1
            after_new = _teacher_under(model, new, p, c.response_ids)[cut:]
            if partial == "recompute":
                assert torch.allclose(lp[cut:], after_new, atol=TOL), "recompute: the new weights' log-probs exactly"
            else:
                worst_keep = max(worst_keep, float((lp[cut:] - after_new).abs().max()))
        if cut == 0:  # started after the load: the new weights' exactly, whatever the mode
            assert torch.allclose(lp, _teacher_under(model, new, p, c.response_ids), atol=TOL)
    if partial == "off":
        assert crossed == 0, "off: no sample crosses a load"
    else:
        assert crossed == len(prompts), "every running sample crossed the load"
    if partial == "keep":
        print(f"keep: max |rollout - new weights' teacher-forced| after the load = {worst_keep:.3g}")
        assert worst_keep > TOL, "keep continues on the old weights' cache, which the new weights do not reproduce"


def test_suspend_then_continue_draws_what_an_uninterrupted_sample_draws(setup, prompts):  # noqa: F811
    engine, model, old, new = setup
    engine.load_weights(old, 0)
    whole = _serve(engine, _requests(prompts), StepControl("keep"), None, "load")
    cut = _serve(engine, _requests(prompts), StepControl("keep"), LOAD_AT, "suspend")
    assert all(c.finish_reason == SUSPENDED for c in cut.values())
    rest = [TurnRequest(i, p + cut[i].response_ids, i, PARAMS.max_new_tokens - len(cut[i].response_ids), i, seed=5,
                        offset=len(cut[i].response_ids)) for i, p in enumerate(prompts)]
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
