"""A batch that does not divide over the trainer's ranks (verl's 512 x 16 samples on 12 ranks):
the split by hand, and the update on two gloo ranks (3 and 5 samples, mini-batches that do not
divide either) against the same batch on one rank: the same loss, grad norm and new weights."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from offstep.batch import Sample, collate
from offstep.train.shards import FILLER, local_mini, shard_plan, take_rows, unshard


def test_plan_even_is_the_contiguous_split():
    assert shard_plan(8, 2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert local_mini(8, 2, 4) == 2


def test_plan_uneven_splits_each_mini_batch():
    # 5 rows, one mini-batch: shares of 3 and 2, the second padded to 3.
    assert shard_plan(5, 2, 5) == [[0, 1, 2], [3, 4, FILLER]]
    # 6 rows in mini-batches of 3: each mini-batch is rows [3j, 3j+3) as on one rank.
    assert shard_plan(6, 2, 3) == [[0, 1, 3, 4], [2, FILLER, 5, FILLER]]
    assert local_mini(6, 2, 3) == 2
    # verl's fully-async DAPO on 4+12 GPUs: 8192 samples, mini-batches of 512, 12 ranks.
    plan = shard_plan(8192, 12, 512)
    assert {len(p) for p in plan} == {16 * 43}
    assert sorted(i for p in plan for i in p if i != FILLER) == list(range(8192))


def _batch(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p, r = 3 + i % 4, 2 + (5 * i) % 7
        samples.append(
            Sample(
                uid=i // 2,
                prompt_ids=torch.randint(3, 500, (p,), generator=g).tolist(),
                response_ids=torch.randint(3, 500, (r,), generator=g).tolist(),
                rollout_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
                finish_reason="stop",
                score=float(i % 2),
                version=0,
            )
        )
    batch = collate(samples, pad_id=0)
    batch.advantages = torch.randn(n, 1, generator=g) * batch.response_mask
    return batch


def test_fillers_carry_no_token_and_unshard_restores_order():
    batch = _batch(5)
    plan = shard_plan(5, 2, 5)
    share = take_rows(batch, plan[1])
    assert len(share) == 3 and float(share.response_mask[2].sum()) == 0 and float(share.advantages[2].abs().sum()) == 0
    gathered = torch.cat([torch.arange(3), torch.tensor([3, 4, -7])]).float()
    assert unshard(gathered, plan, 5).tolist() == [0, 1, 2, 3, 4]


CASES = [(5, 0, "token-mean"), (3, 0, "seq-mean-token-mean"), (6, 3, "token-mean")]  # (rows, mini-batch, mode)


def _run(rank: int, world: int, port: int, out) -> None:
    """Each case on a fresh actor (one process group for all: process starts cost the most)."""
    import torch.distributed as dist

    from offstep.config.schema import ActorConfig, AlgorithmConfig
    from offstep.models.loading import resolve_model
    from offstep.train.actor import ActorWorker
    from offstep.train.distributed import GroupSpec

    spec = GroupSpec(rank, world, "127.0.0.1", port, "cpu", 1)
    results = []
    for n, mini, mode in CASES:
        actor = ActorWorker(
            spec,
            0,
            str(resolve_model("tiny")),
            "float32",
            "float32",
            ActorConfig(micro_batch_size=2, mini_batch_size=mini),
            AlgorithmConfig(loss_agg_mode=mode, use_kl_loss=False),
            1.0,
        )
        batch = _batch(n)
        logp, _ = actor.compute_logprobs(batch)
        metrics, _ = actor.update(batch)
        params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in actor.model.parameters()]
        results.append((metrics, logp.numpy(), [p.numpy().copy() for p in params]))  # by value: the child ends first
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def _spawn(world: int) -> list:
    from offstep.dist import serve_store

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = serve_store("127.0.0.1", world) if world > 1 else None
    port = store.port if store is not None else 0
    procs = [ctx.Process(target=_run, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = out.get(timeout=300)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    return [(m, torch.from_numpy(lp), [torch.from_numpy(p) for p in ps]) for m, lp, ps in results]


@pytest.mark.slow
def test_two_ranks_uneven_equal_one_rank():
    """Batches of 5 and 3 samples on two ranks (shares 3 + 2 and 2 + 1, padded), and 6 in
    mini-batches of 3: log-probs, loss, grad norm and updated weights as on one rank."""
    for (n, _, _), (m1, lp1, p1), (m2, lp2, p2) in zip(CASES, _spawn(1), _spawn(2)):
        mask = _batch(n).response_mask.bool()
        torch.testing.assert_close(lp2[mask], lp1[mask], rtol=1e-5, atol=1e-6)
        for key in ("pg_loss", "loss", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), (n, key)
        assert m1["grad_norm"] > 0
        for a, b in zip(p1, p2):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
