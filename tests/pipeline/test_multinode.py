"""Several Ray nodes on one machine: the trainer pool on one node and the rollout pool on another
(object-store and collective weight sync), FSDP2 over two nodes, and the rollout node removed in
the middle of a run, with and without a spare node.

The cluster is Ray's own ``ray.cluster_utils.Cluster``: a head node without cores (the driver
joins it) and extra raylets on this machine, each a Ray node of its own with its own node id,
object store and custom resources. Pools are pinned to nodes by those resources
(``resources.custom_resources_per_trainer_worker``, ``rollout.custom_resources_per_replica``).
Every run is the ``offstep train`` command in a process of its own, joined to the cluster with
``resources.ray_address``; each worker reports its node from inside (``ray.get_runtime_context()``)
and the command logs it ("offstep: placement: ...").

What one machine cannot show: separate hosts (every node here has the same IP address, so an
address that only works on one host would still work) and NCCL (no GPU).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from blocking_reward import BLOCKING_REWARD as REWARD
from run_records import step_records  # per step, everything but wall-clock figures

from offstep.launch.loader import load_config
from offstep.pipeline.checkpoints import complete_checkpoints

# Slow enough (0.2 s a sample, 8 samples a batch) that a node can be removed while the run is
# well inside its steps.
SLOW_REWARD = '''
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep(0.2)
    return (len(solution_str) % 3) / 2.0
'''

TRAIN = "resources.custom_resources_per_trainer_worker"
ROLLOUT = "rollout.custom_resources_per_replica"


@contextmanager
def local_cluster(**nodes: dict):
    """A Ray cluster on this machine: a head node without cores and one raylet per ``nodes``
    entry (name -> ``Cluster.add_node`` arguments). Yields ``(cluster, {name: node})``.

    It lives in a temp dir of its own (``RAY_TMPDIR``): Ray records the address of the cluster
    it last started in ``<temp dir>/ray/ray_current_cluster``, where any other process's plain
    ``ray.init()`` would find it and join it. On exit every node is removed and no process of the
    cluster may be left."""
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="osn", dir="/tmp")  # short: Ray's socket paths live under it
    # A removed node is declared dead after 3 missed health checks 0.5 s apart rather than Ray's
    # default 5 x 3 s: the tests that remove one wait for that, and nothing else changes.
    health = dict(
        RAY_health_check_period_ms="500", RAY_health_check_timeout_ms="1000", RAY_health_check_failure_threshold="3"
    )
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_enable_metrics_collection", *health)}
    os.environ.update(RAY_TMPDIR=tmp, RAY_enable_metrics_collection="0", **health)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        added = {name: cluster.add_node(**args) for name, args in nodes.items()}
        cluster.wait_for_nodes()
        yield cluster, added
    finally:
        if cluster is not None:
            cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        time.sleep(1)
        left = subprocess.run(["pgrep", "-f", tmp], capture_output=True, text=True).stdout.split()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"processes of the cluster left running: {left}"


def _node(cpus: int, **resources) -> dict:
    return {"num_cpus": cpus, "resources": resources}


def _args(cluster, out: Path, reward: Path, *extra: str) -> list[str]:
    return [
        "preset=tiny",
        f"trainer.output_dir={out}",
        f"resources.ray_address={cluster.address}",
        "trainer.total_steps=3",
        "trainer.save_freq=0",
        "trainer.val_freq=0",
        "trainer.val_before_train=false",
        "trainer.progress=plain",
        "trainer.status_interval_s=0",
        f"reward.custom_path={reward}",
        "reward.num_threads=1",
        *extra,
    ]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "offstep.cli", "train", *args],
            start_new_session=True,
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
        )


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """Wait at most ``timeout`` seconds for the command (a hang fails the test); its log."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)  # the driver prints its threads' and tasks' stacks into the log
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the run did not end within {timeout:.0f} s:\n{log.read_text()[-4000:]}") from None
    return log.read_text()


def _run(args: list[str], log: Path, timeout: float = 300) -> str:
    text = _finish(_start(args, log), log, timeout)
    assert "offstep: done" in text, text[-4000:]
    return text


def _placement(log: str) -> dict[str, str]:
    """role -> the 8-digit node id it reported ("actor rank 0" -> "1a2b3c4d"), from the command's log."""
    line = re.search(r"offstep: placement: (.*)", log)
    assert line, f"no placement line in the log:\n{log[-4000:]}"
    return dict(re.findall(r"([a-z]+ (?:rank|replica) \d+) on node ([0-9a-f]{8})", line.group(1)))


def _short(node) -> str:
    return node.node_id[:8]


@pytest.fixture(scope="module")
def cluster():
    """Nodes: "one" (3 cores, all pools fit), two trainer nodes and one rollout node (1 core each)."""
    with local_cluster(
        one=_node(3, node_one=3),
        train_a=_node(1, node_train=1),
        train_b=_node(1, node_train=1),
        rollout=_node(1, node_rollout=1),
    ) as c:
        yield c


def _same_run_on_one_and_on_split_nodes(cluster, tmp_path, *variants: tuple[str, ...]) -> list[dict]:
    """The same run on node "one" (every pool there), then with the trainer pool on the trainer
    nodes and the rollout pool on the rollout node, once per entry of ``variants`` (extra overrides;
    the run on one node takes the first). Returns the placements of the split runs; asserts every
    run's records equal."""
    c, nodes = cluster
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    one = _run(
        _args(c, tmp_path / "one", reward, *variants[0], f"+{TRAIN}.node_one=1", f"+{ROLLOUT}.node_one=1"),
        tmp_path / "one.log",
    )
    on_one = _placement(one)
    assert set(on_one.values()) == {_short(nodes["one"])}, on_one
    a = step_records(tmp_path / "one")
    assert sorted(a) == [1, 2, 3]
    placements = []
    for i, extra in enumerate(variants):
        split = _run(
            _args(c, tmp_path / f"split{i}", reward, *extra, f"+{TRAIN}.node_train=1", f"+{ROLLOUT}.node_rollout=1"),
            tmp_path / f"split{i}.log",
        )
        on_split = _placement(split)
        assert on_split["rollout replica 0"] == _short(nodes["rollout"]), on_split
        b = step_records(tmp_path / f"split{i}")
        assert sorted(b) == [1, 2, 3]
        collective = "pipeline.weight_sync=collective" in extra
        for step in a:
            assert b[step].pop("sync/collective") == float(collective) and a[step].get("sync/collective") == float(
                "pipeline.weight_sync=collective" in variants[0]
            ), step  # the path each run took
            assert {**a[step], "sync/collective": None} == {**b[step], "sync/collective": None}, (
                f"step {step} differs between one node and two ({extra})"
            )
        placements.append(on_split)
    return placements


@pytest.mark.ray
def test_trainer_and_rollout_pools_on_different_nodes(cluster, tmp_path):
    """Actor on a trainer node, rollout replica on the rollout node: the weight sync (the gloo
    broadcast group whose store actor rank 0 serves on its node) crosses the node boundary, and
    every step's rewards, losses and KL equal the run with both pools on one node. (The object
    store's path gives runs equal to this one, tests/sync/test_sync.py; across nodes it is Ray's
    object transfer, which the run that loses its only rollout node, below, takes.)"""
    _, nodes = cluster
    for split in _same_run_on_one_and_on_split_nodes(cluster, tmp_path, ("pipeline.weight_sync=collective",)):
        assert split["actor rank 0"] in {_short(nodes["train_a"]), _short(nodes["train_b"])}, split
        assert split["actor rank 0"] != split["rollout replica 0"]


@pytest.mark.ray
def test_fsdp_across_two_nodes(cluster, tmp_path):
    """FSDP2 with 2 trainer ranks, one per trainer node: the process group meets at the driver's
    store across nodes, and the run equals the 2-rank run on one node, step for step."""
    _, nodes = cluster
    [split] = _same_run_on_one_and_on_split_nodes(cluster, tmp_path, ("resources.trainer_workers=2",))
    ranks = {split["actor rank 0"], split["actor rank 1"]}
    assert ranks == {_short(nodes["train_a"]), _short(nodes["train_b"])}, split


def _kill_rollout_node_mid_run(c, nodes: dict, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, str]:
    """Start a 6-step run (checkpoints every 2 steps), remove the node of its rollout replica once
    the step-2 checkpoint is complete; returns the process, its log and the removed node's id."""
    reward = tmp_path / "slow.py"
    reward.write_text(SLOW_REWARD)
    log = tmp_path / "run.log"
    args = _args(
        c,
        tmp_path / "run",
        reward,
        "trainer.total_steps=6",
        "trainer.save_freq=2",
        f"+{TRAIN}.node_train=1",
        f"+{ROLLOUT}.node_rollout=1",
        *extra,
    )
    proc = _start(args, log)
    gate = tmp_path / "run" / "checkpoints" / "step_000002" / "trainer_state.json"
    t0 = time.time()
    while not gate.exists():
        if proc.poll() is not None or time.time() - t0 > 300:
            _finish(proc, log, 1)
            raise AssertionError(f"no step-2 checkpoint (rc {proc.returncode}):\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    where = _placement(log.read_text())["rollout replica 0"]
    victim = next(name for name, n in nodes.items() if _short(n) == where)
    assert victim.startswith("rollout"), (where, victim)
    c.remove_node(nodes[victim], allow_graceful=False)
    return proc, log, where


@pytest.mark.ray
def test_rollout_node_lost_with_a_spare_node_the_run_goes_on(tmp_path):
    """Two nodes can hold the rollout replica. Its node is removed mid-run: the replacement starts
    on the other one, gets the current weights, and the run completes every step; the broadcast
    group is made again with the replacement, across the nodes, and carries the syncs after it.
    (The collective path only: it is the object store's restart, which
    tests/pipeline/test_stops_and_failures.py's replica-death test covers, plus the group rebuilt.)"""
    sync = "collective"
    with local_cluster(
        train=_node(1, node_train=1), rollout_a=_node(1, node_rollout=1), rollout_b=_node(1, node_rollout=1)
    ) as (c, nodes):
        proc, log, removed = _kill_rollout_node_mid_run(c, nodes, tmp_path, f"pipeline.weight_sync={sync}")
        text = _finish(proc, log, 300)
    assert proc.returncode == 0, text[-4000:]
    restarted = re.search(r"rollout replica 0 restarted on node ([0-9a-f]{8})", text)
    assert restarted, text[-4000:]
    survivor = next(_short(n) for name, n in nodes.items() if name.startswith("rollout") and _short(n) != removed)
    assert restarted.group(1) == survivor
    records = step_records(tmp_path / "run")
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert all(m["rollout/staleness_max"] <= 1 for m in records.values())
    assert records[6]["sync/collective"] == float(sync == "collective"), records[6]


@pytest.mark.ray
def test_rollout_node_lost_without_a_spare_stops_cleanly_and_resumes(tmp_path):
    """Only one node can hold the rollout replica, and it is removed mid-run: the run stops once
    the replacement's bundle has waited the placement time (resources.placement_timeout_s, 15 s
    here) for a node, with a message that says why, its last checkpoint is complete, and once a new
    rollout node joins, the same command resumes from it and finishes."""
    with local_cluster(train=_node(1, node_train=1), rollout=_node(1, node_rollout=1)) as (c, nodes):
        t0 = time.time()
        proc, log, _ = _kill_rollout_node_mid_run(c, nodes, tmp_path, "resources.placement_timeout_s=15")
        t_kill = time.time()
        text = _finish(proc, log, 240)
        assert proc.returncode == 2, text[-4000:]
        assert time.time() - t_kill < 135, "the run took too long to give up"
        assert "no node of the Ray cluster had room for its replacement within 15 s" in text, text[-4000:]
        assert "trainer.resume=auto" in text
        found = complete_checkpoints(tmp_path / "run" / "checkpoints")
        assert found and found[-1][0] in (2, 4), found
        before = sorted(step_records(tmp_path / "run"))
        assert before == list(range(1, before[-1] + 1)) and before[-1] < 6

        c.add_node(**_node(1, node_rollout=1))
        reward = tmp_path / "slow.py"
        args = _args(
            c,
            tmp_path / "run",
            reward,
            "trainer.total_steps=6",
            "trainer.save_freq=2",
            f"+{TRAIN}.node_train=1",
            f"+{ROLLOUT}.node_rollout=1",
            "resources.placement_timeout_s=15",
        )
        resumed = _run(args, tmp_path / "resume.log")
        assert f"resumed from {found[-1][1]}" in resumed, resumed[-4000:]
    assert sorted(step_records(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]
    assert time.time() - t0 < 600


# ------------------------------------------------------------------ no Ray: the placement check
def test_the_placement_wait_must_be_positive():
    from offstep.launch.validate import problems

    assert any(
        "resources.placement_timeout_s=0.0 must be > 0" in m
        for m in problems(load_config(["preset=tiny", "resources.placement_timeout_s=0"]))
    )


def test_check_placeable_names_the_key_and_what_nodes_have():
    from offstep.pipeline.pools import check_placeable

    def node(nid, **res):
        return {"Alive": True, "NodeID": nid * 7, "Resources": {"CPU": 1.0, f"node:{nid}": 1.0, **res}}

    nodes = [
        node("aaaaaaaa", node_train=1.0),
        node("bbbbbbbb", node_rollout=1.0),
        {"Alive": False, "NodeID": "c" * 56, "Resources": {"CPU": 4.0, "gpu_node": 1.0}},
    ]
    assert check_placeable(nodes, {"CPU": 1}, TRAIN) is None  # no custom resources: Ray's own wait
    assert check_placeable(nodes, {"CPU": 1, "node_train": 1}, TRAIN) is None
    # a node that has left the cluster does not count
    problem = check_placeable(nodes, {"CPU": 1, "gpu_node": 1}, ROLLOUT)
    assert problem.startswith(f"{ROLLOUT}={{'gpu_node': 1}}: no node of the Ray cluster has the resource 'gpu_node'")
    assert "{'aaaaaaaa': {'node_train': 1.0}, 'bbbbbbbb': {'node_rollout': 1.0}}" in problem
    # every resource exists, but no node has them all, or not enough of one
    assert "no single node" in check_placeable(nodes, {"CPU": 1, "node_train": 1, "node_rollout": 1}, TRAIN)
    assert "no single node" in check_placeable(nodes, {"CPU": 2, "node_train": 1}, TRAIN)
    assert "no single node" in check_placeable(nodes, {"CPU": 1, "node_train": 2}, TRAIN)


def test_custom_resources_need_a_cluster_and_positive_amounts():
    from offstep.launch.loader import ConfigError, load_config
    from offstep.launch.preflight import validate

    with pytest.raises(
        ConfigError, match=rf"{TRAIN}=\{{'node_train': 1.0\}} asks for custom Ray resources.*resources.ray_address"
    ):
        validate(load_config(["preset=tiny", f"+{TRAIN}.node_train=1"]))
    with pytest.raises(
        ConfigError, match=rf"{ROLLOUT}: \{{'CPU': 1.0, 'x': 0.0\}} must be custom resources with amounts > 0"
    ):
        validate(load_config(["preset=tiny", "resources.ray_address=auto", f"+{ROLLOUT}.CPU=1", f"+{ROLLOUT}.x=0"]))


def test_gloo_binds_the_interface_that_reaches_the_store(monkeypatch):
    """A group's store at 127.0.0.1 (a local run): gloo's listeners go on loopback. A store at
    this machine's own outward address: the interface that holds it. A user's own
    GLOO_SOCKET_IFNAME is kept."""
    import socket

    import psutil

    from offstep.dist import bind_gloo_to_route, route_interface

    def addresses(iface):
        return {a.address for a in psutil.net_if_addrs()[iface]}

    assert "127.0.0.1" in addresses(route_interface("127.0.0.1"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.123", 9))  # a documentation address: only the route is looked up
        outward = s.getsockname()[0]
    assert outward in addresses(route_interface(outward))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    bind_gloo_to_route("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == route_interface("127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    bind_gloo_to_route("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine0"
