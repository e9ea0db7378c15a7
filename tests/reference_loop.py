"""The synchronous loop written out in one process (no Ray, no asyncio, the obvious order), for the
invariant that k = 0 through Ray equals it step for step (tests/e2e/test_pipeline_e2e.py with plain
rows, tests/e2e/test_agent_pipeline.py with tool rows)."""

from __future__ import annotations

import pytest

from offstep.telemetry.names import Actor, ResponseLength, Reward, Rollout


def assert_matches_in_process_reference(cfg, metrics: list[dict], ref_dir) -> None:
    """Rerun ``cfg`` (a k = 0 run whose per-step ``metrics`` were logged) as a plain loop over the
    same parts and compare each step's reward, response length, losses and gradient norm."""
    import torch

    from offstep.algos.advantages import grpo_outcome_advantage
    from offstep.batch import collate
    from offstep.data.prompt_stream import PromptStream
    from offstep.pipeline.fleet import gen_seed
    from offstep.pipeline.inputs import prepare_inputs, to_request
    from offstep.rollout.replica_spec import RolloutSpec
    from offstep.rollout.types import SamplingParams
    from offstep.rollout.worker import RolloutWorker
    from offstep.sync.weights import pack_state_dict
    from offstep.train.actor import ActorWorker
    from offstep.train.distributed import GroupSpec

    assert all(m[Rollout.STALENESS_MAX] == 0 for m in metrics)
    inputs = prepare_inputs(cfg, ref_dir)
    stream = PromptStream(len(inputs.train), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
    r = cfg.rollout
    params = SamplingParams(
        n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens
    )
    rollout = RolloutWorker(RolloutSpec.local(inputs.model_path, inputs.reward, r.max_batch_size, agent=inputs.agent))
    spec = GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1)
    actor = ActorWorker(
        spec,
        cfg.trainer.seed,
        inputs.model_path,
        "float32",
        "float32",
        cfg.actor,
        cfg.algorithm,
        r.temperature,
        reference=cfg.algorithm.needs_reference,
    )
    try:
        for step in range(1, len(metrics) + 1):
            _, idx = stream.next_batch()
            reqs = [to_request(inputs.train[i], step * len(idx) + j) for j, i in enumerate(idx)]
            samples, _ = rollout.generate(reqs, params, gen_seed(cfg.trainer.seed, step, 0))
            batch = collate(samples, inputs.pad_id)
            batch.ref_logprobs, _ = actor.compute_ref_logprobs(batch)
            batch.advantages, batch.returns = grpo_outcome_advantage(batch.scores, batch.group_ids, batch.response_mask)
            am, _ = actor.update(batch)
            rollout.load_weights(pack_state_dict(actor.full_state_dict(actor.model)), step)
            m = metrics[step - 1]
            assert m[Reward.MEAN] == pytest.approx(float(batch.scores.mean()), abs=0)
            assert m[ResponseLength.MEAN] == pytest.approx(
                float(batch.attention_mask[:, batch.prompt_len :].sum(-1).float().mean()), abs=0
            )
            assert m[Actor.PG_LOSS] == pytest.approx(am["pg_loss"], rel=1e-5, abs=1e-7)
            assert m[Actor.KL] == pytest.approx(am["kl"], rel=1e-5, abs=1e-7)
            assert m[Actor.GRAD_NORM] == pytest.approx(am["grad_norm"], rel=1e-5)
    finally:
        actor.shutdown()
        torch.set_num_threads(max(1, torch.get_num_threads()))
