"""The discrete-event model of ``benchmarks/lend_devices_sim.py``, on schedules worked by hand:
one GPU for the trainer and one replica of one GPU, equal lengths (sigma 0), so that every event
falls on a whole second."""

from dataclasses import replace

import pytest

from benchmarks.lend_devices_sim import Setting, simulate, with_share

# 1 group of 4 samples a step, each 10 tokens, no prompt; a decode step 1 s whatever the load; the
# update 0.5 s a token: 20 s a batch on the trainer's one GPU; a sync 1 s
TINY = Setting(
    devices=2,
    trainer=1,
    per_replica=1,
    slots=4,
    hybrid_slots=4,
    step0_s=1.0,
    step1_s=0.0,
    groups=1,
    n=4,
    prompt=0,
    median=10.0,
    sigma=0.0,
    cap=100,
    train_s_per_token=0.5,
    sync_s=1.0,
    switch_in_s=0.0,
    switch_out_s=0.0,
    k=0,
    steps=4,
)


def test_synchronous_step_is_generation_then_update_then_sync():
    r = simulate(TINY)
    assert r.ends == [31.0, 62.0, 93.0, 124.0]  # 10 s decoding, 20 s update, 1 s sync
    assert r.samples_per_s == pytest.approx(4 / 31)
    assert r.wait_s == 10.0 and r.staleness == 0 and r.decoded == pytest.approx(4 * 4 * 10)


def test_one_step_hides_generation_behind_the_update():
    # k = 1: groups 0 and 1 are admitted at the start; group 0 decodes 0-10 s, group 1 10-20 s (4
    # slots); the trainer takes group 0 at 10 s: update 10-30, sync 30-31; group 2 is admitted at
    # 31 and decodes 31-41 while group 1 (done at 20) trains 31-51; and so on: a step is 21 s
    r = simulate(replace(TINY, k=1, slots=4))
    assert r.ends == [31.0, 52.0, 73.0, 94.0]
    assert r.step_s == 21.0 and r.staleness == 1


def test_load_dependent_decode_step():
    # 4 samples running: a step takes 1 + 4 x 0.25 = 2 s, so a group decodes in 20 s
    r = simulate(replace(TINY, step1_s=0.25))
    assert r.ends[0] == 20.0 + 20.0 + 1.0


def test_lent_trainer_gpu_doubles_the_slots_while_it_waits():
    # 2 slots a replica: alone, the standalone replica decodes the group in two waves (20 s); with the
    # trainer's GPU lent (no switch cost), 4 slots take it in one (10 s)
    fixed = simulate(replace(TINY, slots=2, hybrid_slots=2))
    lent = simulate(replace(TINY, slots=2, hybrid_slots=2, lend=True))
    assert fixed.ends[0] == 20.0 + 20.0 + 1.0
    assert lent.ends == [31.0, 62.0, 93.0, 124.0]
    assert lent.lends == 4 and lent.lent_s == 10.0


def test_switch_costs_and_rebalanced_samples_keep_their_tokens():
    # Waking takes 2 s, during which the standalone replica decodes 2 tokens of samples A and B. The
    # four samples are then spread over both replicas, A and B with their 2 tokens: A, B end at
    # 2 + 8 = 10 s, C, D at 12 s. Reclaiming takes 3 s: the update runs 15-35, the sync 35-36.
    s = replace(TINY, slots=2, hybrid_slots=2, lend=True, switch_in_s=2.0, switch_out_s=3.0)
    r = simulate(s)
    assert r.ends[0] == 36.0 and r.wait_s == 15.0 and r.lent_s == 10.0
    assert r.decoded == pytest.approx(4 * 4 * 10)  # no token decoded twice, none lost


def test_no_lending_when_the_last_wait_was_shorter_than_a_round_trip():
    # switches of 100 s each way: the first step lends (no wait measured yet); the group is done at
    # 20 s, while the hybrid replica still wakes; reclaimed at 200 s, that wait is not longer than
    # the round trip, so no later step lends, and each waits for two waves on the replica alone
    r = simulate(replace(TINY, slots=2, hybrid_slots=2, lend=True, switch_in_s=100.0, switch_out_s=100.0))
    assert r.lends == 1
    assert r.ends[1] - r.ends[0] == 20.0 + 20.0 + 1.0  # the later steps as without lending


def test_hybrid_only_is_colocated():
    # every GPU trains and lends: the replica is the trainer's, generation only while it waits
    r = simulate(replace(TINY, devices=1, trainer=1, lend=True, switch_in_s=1.0, switch_out_s=1.0))
    assert r.ends == [33.0, 66.0, 99.0, 132.0]  # 1 s wake, 10 s decoding, 1 s reclaim, 20 s update, 1 s sync


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("lend", [False, True])
def test_staleness_bound_holds_with_a_tail(k, lend):
    s = with_share(
        Setting(
            devices=8,
            trainer=4,
            per_replica=2,
            slots=8,
            hybrid_slots=4,
            groups=4,
            n=4,
            median=50.0,
            sigma=1.0,
            cap=400,
            steps=6,
            k=k,
            lend=lend,
        ),
        0.3,
    )
    r = simulate(s)
    assert r.staleness <= k and len(r.ends) == s.steps
    assert r.ends == sorted(r.ends)


def test_no_replica_is_refused():
    with pytest.raises(ValueError, match="no replica"):
        simulate(replace(TINY, devices=1, trainer=1))
