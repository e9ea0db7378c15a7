"""The sandbox/ metrics of a step: a rollout worker hands back the executions of its generation
call (code rewards scored, python tools run) with its timing, and the step sums them. No Ray."""

import json

import pytest

from offstep.batch import GenTiming, Span
from offstep.config.schema import SandboxConfig
from offstep.pipeline.step_metrics import sandbox_metrics
from offstep.sandbox import Execution, shared
from offstep.telemetry.names import Sandbox


def test_the_figures_over_the_replicas():
    runs = [Execution(s, 0.1 * i, s > 5) for i, s in enumerate([1.0, 2.0, 3.0, 4.0, 10.0] * 4)]
    results = [
        ([], GenTiming(Span(0, 1), sandbox=tuple(runs[:12]))),
        ([], GenTiming(Span(0, 1), sandbox=tuple(runs[12:]))),
    ]
    m = sandbox_metrics(results)
    # 20 runs: 4 at 10 s timed out; mean (1+2+3+4+10)/5 = 4; p95 by nearest rank: the 19th of 20 sorted = 10;
    # mean wait 0.1 x (0+...+19)/20 = 0.95
    assert m == pytest.approx(
        {
            Sandbox.EXECUTIONS: 20,
            Sandbox.TIMEOUTS: 4,
            Sandbox.SECONDS_MEAN: 4.0,
            Sandbox.SECONDS_P95: 10.0,
            Sandbox.QUEUE_WAIT_S: 0.95,
        }
    )
    assert sandbox_metrics([([], GenTiming(Span(0, 1)))]) == {}


@pytest.mark.heavy
def test_a_rollout_worker_reports_the_executions_of_its_code_rewards():
    from offstep.models.loading import resolve_model
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import Request, RolloutSpec
    from offstep.rollout.types import SamplingParams
    from offstep.rollout.worker import RolloutWorker

    worker = RolloutWorker(
        RolloutSpec.local(resolve_model("tiny"), RewardFunction(), 8, sandbox=SandboxConfig(timeout_s=3, concurrency=1))
    )
    shared().log.drain()  # executions of earlier tests in this process belong to no generation of this worker
    truth = json.dumps({"inputs": ["1", "2"], "outputs": ["1", "2"]})
    prompt = worker._tok("Write a program.", add_special_tokens=False).input_ids
    samples, timing = worker.generate(
        [Request(0, prompt, "codecontests", truth)], SamplingParams(n=2, max_new_tokens=8), 0
    )
    # the random model's text is no program (a syntax error or a wrong output): each sample runs both tests
    assert [s.reward_extra["tests_run"] for s in samples] == [2.0, 2.0]
    m = sandbox_metrics([(samples, timing)])
    assert (
        m[Sandbox.EXECUTIONS] == 4
        and m[Sandbox.TIMEOUTS] == 0
        and 0 < m[Sandbox.SECONDS_MEAN] <= m[Sandbox.SECONDS_P95]
    )
    assert (
        worker.generate([Request(0, prompt, "arithmetic", "1")], SamplingParams(n=1, max_new_tokens=4), 0)[1].sandbox
        == ()
    )
