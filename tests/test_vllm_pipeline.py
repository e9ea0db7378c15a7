"""The whole pipeline with ``rollout.engine=vllm`` on the tiny preset, for k = 0 and 1, against the
built-in engine: the same staleness pattern, the same versions per batch, the same metric names,
and rollout log-probs that agree with the trainer's. (Resume, a dying worker, Ctrl-C, dynamic
sampling and the default preset take ``engine`` as a parameter where they are tested for the
built-in engine: ``conftest.ENGINES``.)"""

from __future__ import annotations

import pytest
from conftest import needs_vllm

from offstep.config.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl

pytestmark = needs_vllm


def _run(out, engine: str, k: int, steps: int, *extra: str):
    train(load_config([
        "preset=tiny", f"rollout.engine={engine}", f"pipeline.max_staleness={k}", f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}", "trainer.progress=off", "data.task_val_size=8", *extra,
    ]))
    metrics = read_jsonl(out / "metrics.jsonl")
    timeline = read_jsonl(out / "timeline.jsonl")
    return [m for m in metrics if m["step"] >= 1], metrics, timeline


@pytest.mark.parametrize("k,extra", [(0, ("pipeline.ref_on_rollout=true",)), (1, ())], ids=["sync-ref-on-rollout", "one-step"])
def test_vllm_pipeline_matches_builtin(tmp_path, ray_session, k, extra):
    steps = 3
    runs = {e: _run(tmp_path / e, e, k, steps, *extra) for e in ("builtin", "vllm")}
    (b_steps, b_all, b_tl), (v_steps, v_all, v_tl) = runs["builtin"], runs["vllm"]
    assert [m["step"] for m in v_steps] == [1, 2, 3]
    assert [m["rollout/staleness_max"] for m in v_steps] == [m["rollout/staleness_max"] for m in b_steps] \
        == ([0, 0, 0] if k == 0 else [0, 1, 1])
    assert [m["policy_version"] for m in v_steps] == [1, 2, 3]
    gen = lambda tl: [e["version"] for e in tl if e["stage"] == "gen"]  # noqa: E731
    assert gen(v_tl) == gen(b_tl) == ([0, 1, 2] if k == 0 else [0, 0, 1])
    # The same metrics, validation included (before training and at the end).
    for b, v in zip(b_all, v_all):
        assert set(b) == set(v), set(b) ^ set(v)
    assert "val/acc" in v_all[0] and v_all[0]["step"] == 0 and "val/acc" in v_all[-1]
    for m in v_steps:
        # On a batch of the current policy (staleness 0) vLLM's rollout log-probs, those of the
        # distribution it sampled from (T = 1 here), equal the actor's re-computation up to float32
        # rounding (~3e-7 measured; the built-in engine's ~2e-7). A stale batch adds the policy's own
        # drift over one update, about 1e-3 with either engine.
        if "actor/mismatch_kl_k1/staleness_0" in m:
            assert abs(m["actor/mismatch_kl_k1/staleness_0"]) < 1e-5, m
        assert abs(m["actor/mismatch_kl_k1"]) < 0.05
        assert m["actor/grad_norm"] > 0
    if k == 0:  # the reference ran on the rollout replica, beside vLLM
        assert any(e["stage"] == "ref" and e["role"] == "rollout/0" for e in v_tl)
        assert all("timing_s/ref_rollout" in m for m in v_steps)
