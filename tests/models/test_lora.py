"""LoRA (actor.lora): the config checks, the built-in engine's adapters against peft's own forward,
every adapter sync reaching the rollout engine (verl issue 7495), the reference as the same model
with its adapters off, export as a peft folder and merged, and a tiny run end to end."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ENGINES, needs_vllm

pytest.importorskip("peft")  # a dependency of offstep from this change on; skipped until it is installed

from offstep.config.schema import ActorConfig, AlgorithmConfig, LoRAConfig, OptimConfig
from offstep.launch.loader import ConfigError, load_config
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from offstep.models.lora import adapter_parameters, add_adapters
from offstep.rollout.types import SamplingParams

LORA = LoRAConfig(rank=8)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]


@pytest.fixture(scope="module")
def tiny():
    return resolve_model("tiny")


def _random_adapters(model, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * scale for n, p in adapter_parameters(model)}


def _teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    "overrides,match",
    [
        (["algorithm.adv_estimator=gae"], "critic is a second full model"),
        (["actor.lora.target_modules=[q_proj,qkv]"], "'qkv' matches no linear layer.*named \\['down_proj'"),
        (["actor.lora.rank=48"], "rank=48 is larger than the width.*k_proj \\(32\\).*rank <= 32"),
        (["actor.lora.dropout=1.5"], "actor.lora.dropout=1.5 must be in"),
    ],
)
def test_lora_config_errors_name_the_fix(overrides, match):
    from offstep.launch.preflight import validate

    with pytest.raises(ConfigError, match=match):
        validate(load_config(["preset=tiny", "actor.lora.rank=8", *overrides]), cpu_count=8, gpu_count=0)


@needs_vllm
def test_vllm_lora_reference_on_rollout_needs_an_untempered_reference():
    """vLLM scores the reference (its base) with prompt log-probs, which it does not temper and its
    LoRA LM head cannot give: at another temperature, or with lm_head adapted, the reference on the
    rollout side is refused, with the ways out."""
    from offstep.launch.preflight import validate

    base = ["preset=tiny", "actor.lora.rank=8", "rollout.engine=vllm", "pipeline.ref_on_rollout=true"]
    with pytest.raises(ConfigError, match="rollout.temperature=0.7.*pipeline.ref_on_rollout=false"):
        validate(load_config([*base, "rollout.temperature=0.7"]), cpu_count=8, gpu_count=0)
    with pytest.raises(ConfigError, match="adapted lm_head.*drop lm_head"):
        validate(load_config([*base, "actor.lora.target_modules=[q_proj,lm_head]"]), cpu_count=8, gpu_count=0)
    validate(load_config([*base, "rollout.temperature=1.0"]), cpu_count=8, gpu_count=0)
    validate(load_config([*base, "rollout.temperature=0.7", "pipeline.ref_on_rollout=false"]), cpu_count=8, gpu_count=0)


def test_lora_defaults_validate():
    from offstep.launch.preflight import validate

    cfg = load_config(["preset=tiny", "actor.lora.rank=16"])
    validate(cfg, cpu_count=8, gpu_count=0)
    assert cfg.actor.lora.scale_alpha == 32.0  # alpha 0: twice the rank
    assert cfg.actor.lora.target_modules == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]


# ------------------------------------------------------------------ the built-in engine's adapters
@pytest.mark.heavy
@pytest.mark.parametrize("runner,merge", [("slots", False), ("hf", False), ("slots", True)])
def test_engine_adapters_equal_peft_forward(tiny, runner, merge):
    """The engine's log-probs with adapters (added as B(A x) in the slot runner, through peft's
    layers in the fallback, or merged) are peft's teacher-forced ones; with them off, the base's."""
    from offstep.rollout.engines.torch_engine import TorchEngine

    tok = load_tokenizer(tiny)
    torch.manual_seed(0)
    model = add_adapters(load_causal_lm(tiny), LORA)
    base = load_causal_lm(tiny)
    engine = TorchEngine(model, tok, eos_token_ids(tok, tiny), runner=runner, merge_adapters=merge)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    for version in (1, 2):  # a second load replaces the first (unmerged first when merged)
        engine.load_adapters(_random_adapters(model, version), version)
        assert engine.version == version
        out = engine.generate(PROMPTS, params, seed=version)
        for c in out:
            prompt = PROMPTS[c.prompt_index]
            peft_lp = _teacher_forced(model, prompt, c.response_ids)  # merged or not, peft's forward
            torch.testing.assert_close(torch.tensor(c.logprobs), peft_lp, atol=2e-4, rtol=0)
            base_lp = _teacher_forced(base, prompt, c.response_ids)
            assert float((base_lp - peft_lp).abs().max()) > 1e-2  # the adapters change the policy
            with engine.adapters_disabled() as off:
                torch.testing.assert_close(_teacher_forced(off, prompt, c.response_ids), base_lp, atol=2e-4, rtol=0)


def test_engine_refuses_adapters_that_do_not_match(tiny):
    """An adapter set with other names (e.g. another adapter name, a missing layer) is refused
    before anything is copied, instead of being silently ignored as peft's loader would."""
    from offstep.rollout.engines.torch_engine import TorchEngine

    tok = load_tokenizer(tiny)
    model = add_adapters(load_causal_lm(tiny), LORA)
    engine = TorchEngine(model, tok, eos_token_ids(tok, tiny))
    good = _random_adapters(model, 1)
    renamed = {k.replace(".default.", ".policy."): v for k, v in good.items()}
    with pytest.raises(KeyError, match="do not match"):
        engine.load_adapters(renamed, 1)
    with pytest.raises(KeyError, match="missing"):
        engine.load_adapters(dict(list(good.items())[1:]), 1)
    assert engine.version == 0
    full = TorchEngine(load_causal_lm(tiny), tok, eos_token_ids(tok, tiny))
    with pytest.raises(KeyError, match="no LoRA adapters"):
        full.load_adapters(good, 1)


# ------------------------------------------------------------------ export and eval, no Ray
@pytest.mark.heavy
def test_export_peft_folder_and_merged_model(tiny, tmp_path):
    """A LoRA checkpoint (adapters only) exports as a peft folder that ``PeftModel.from_pretrained``
    loads, and with merge=True as a plain model with the same outputs; ``offstep eval``'s loader
    takes the adapter folder too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from offstep.config.schema import to_yaml
    from offstep.pipeline.checkpoints import Checkpoints, TrainerState
    from offstep.pipeline.export import export_checkpoint, model_for_eval
    from offstep.train.checkpoint import save_role

    torch.manual_seed(0)
    model = add_adapters(load_causal_lm(tiny), LORA)
    trained = _random_adapters(model, 3)
    with torch.no_grad():
        for n, p in adapter_parameters(model):
            p.copy_(trained[n])
    cfg = load_config(["preset=tiny", "actor.lora.rank=8"])
    ck = Checkpoints(tmp_path / "run")
    staging = ck.staging(2)
    with warnings.catch_warnings():  # DCP: "no process group, assuming a single process"
        warnings.simplefilter("ignore", UserWarning)
        save_role(staging / "actor", 0, model)
    ck.commit(staging, TrainerState(2, 2, 0.0, {"epoch": 0, "position": 0}, [], 0), to_yaml(cfg))
    shards = sum(f.stat().st_size for f in (tmp_path / "run/checkpoints/step_000002/actor").glob("*.distcp"))
    adapters = adapter_parameters(model)
    # the adapters (plus DCP's framing of each tensor), not the frozen base (nor its tied head)
    assert shards < sum(p.numel() * 4 for _, p in adapters) + 2048 * len(adapters)

    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = model(ids).logits
    adapter = export_checkpoint(tmp_path / "run", tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    loaded = PeftModel.from_pretrained(load_causal_lm(tiny), str(adapter))
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(tmp_path / "run", tmp_path / "merged", merge=True))
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    for m in (loaded, merged, AutoModelForCausalLM.from_pretrained(model_for_eval(adapter))):
        with torch.no_grad():
            torch.testing.assert_close(m(ids).logits, want, atol=1e-4, rtol=0)


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (len(solution_str) % 3) / 2.0
'''


# ------------------------------------------------------------------ the reference on the rollout side
@pytest.mark.parametrize("engine", ENGINES)
def test_rollout_reference_is_the_engines_own_base(tmp_path, tiny, engine):
    """``pipeline.ref_on_rollout`` with LoRA loads no second model: the rollout worker's reference
    log-probs are the base model's (peft's forward with the adapters off), both before the first
    adapter load and after each of two, while what it samples follows the adapters (peft's forward
    with them on), which the reference then differs from."""
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import RefSpec, Request, RolloutSpec
    from offstep.rollout.worker import RolloutWorker

    (tmp_path / "r.py").write_text(REWARD)
    scratch = tmp_path / "run" / "tmp"  # the run folder's scratch (start_workers passes it)
    vllm_temp = lambda: {p.name for p in Path(tempfile.gettempdir()).glob("offstep-vllm-lora-*")}  # noqa: E731
    temp_before = vllm_temp()
    worker = RolloutWorker(
        RolloutSpec.local(
            tiny,
            RewardFunction(str(tmp_path / "r.py")),
            16,
            engine=engine,
            lora=LORA,
            scratch=str(scratch),
            ref=RefSpec("float32", "float32", 1.0, 8),
        )
    )
    policy = add_adapters(load_causal_lm(tiny), LORA)  # the trainer's model
    requests = [Request(i, p, "arithmetic", "0") for i, p in enumerate(PROMPTS)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    try:
        assert worker.ref_model is None
        for version in (0, 1, 2):
            if version:  # an "update": new adapters on the trainer's model, synced to the worker
                adapters = _random_adapters(policy, version)
                with torch.no_grad():
                    for name, p in adapter_parameters(policy):
                        p.copy_(adapters[name])
                worker.engine.load_adapters(adapters, version)  # what a sync's load does (RolloutWorker._apply)
                if engine == "vllm":  # the adapter vLLM reads lies in the run's folder, none outside it
                    written = [p for p in scratch.rglob("adapter_model.safetensors")]
                    assert len(written) == 1 and f"adapter-{version}" in str(written[0]), written
                    assert vllm_temp() <= temp_before
            samples, timing = worker.generate(requests, params, seed=10 + version)
            assert timing.ref is not None and {s.version for s in samples} == {version}
            for s in samples:
                adapted = _teacher_forced(policy, s.prompt_ids, s.response_ids)
                with policy.disable_adapter():
                    base = _teacher_forced(policy, s.prompt_ids, s.response_ids)
                torch.testing.assert_close(torch.tensor(s.ref_logprobs), base, atol=5e-4, rtol=0)
                torch.testing.assert_close(torch.tensor(s.rollout_logprobs), adapted, atol=5e-4, rtol=0)
                if version:
                    assert float((base - adapted).abs().max()) > 1e-2, "the adapters do not change the policy"
    finally:
        close = getattr(worker.engine, "close", None)
        if close is not None:
            close()


# ------------------------------------------------------------------ every sync arrives (Ray)


@pytest.mark.ray
@pytest.mark.parametrize("engine", ENGINES)
def test_every_adapter_sync_reaches_the_rollout_engine(ray_free, tmp_path, tiny, engine):
    """verl issue 7495: after each of several syncs (object store and collective, alternating),
    the rollout engine's log-probs of what it generated equal the trainer's for the same tokens,
    and differ from the base model's (the trainer's with adapters off, which is also what the
    rollout worker's reference, ``pipeline.ref_on_rollout``, computes)."""
    import ray

    from offstep.batch import collate
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import RefSpec, Request, RolloutSpec
    from offstep.rollout.worker import RolloutWorker
    from offstep.sync.collective import connect
    from offstep.train.actor import ActorWorker
    from offstep.train.distributed import GroupSpec

    (tmp_path / "r.py").write_text(REWARD)
    env = {"runtime_env": {"env_vars": {"OFFSTEP_CACHE": os.environ["OFFSTEP_CACHE"], "HF_HUB_OFFLINE": "1"}}}
    actor_cfg = ActorConfig(micro_batch_size=8, optim=OptimConfig(lr=0.02), lora=LORA)
    algo = AlgorithmConfig(use_kl_loss=False, entropy_coeff=0.01)
    actor = (
        ray.remote(ActorWorker)
        .options(num_cpus=0.01, **env)
        .remote(GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1), 0, tiny, "float32", "float32", actor_cfg, algo, 1.0)
    )
    rollout = (
        ray.remote(RolloutWorker)
        .options(num_cpus=0.01, **env)
        .remote(
            RolloutSpec.local(
                tiny,
                RewardFunction(str(tmp_path / "r.py")),
                16,
                engine=engine,
                lora=LORA,
                ref=RefSpec("float32", "float32", 1.0, 8),
            )
        )
    )
    requests = [Request(i, p, "arithmetic", "0") for i, p in enumerate(PROMPTS)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10)
    try:
        connect([actor], [rollout], "gloo", bucket_mb=0.01, timeout_s=60)
        for version in (1, 2, 3, 4):
            samples, _ = ray.get(rollout.generate.remote(requests, params, version))
            batch = collate(samples, 0)
            batch.advantages = (
                torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(version)) * batch.response_mask
            )
            ray.get(actor.update.remote(batch))
            if version % 2:
                loads = [rollout.receive_weights.remote(version)]
                ray.get(actor.send_weights.remote(version))
            else:
                exported = ray.get(actor.export_weights.remote())
                loads = [rollout.load_weights.remote(exported[0], version)]
            assert [s.span.version for s in ray.get(loads)] == [version]

            samples, _ = ray.get(rollout.generate.remote(requests, params, 100 + version))
            assert {s.version for s in samples} == {version}
            batch = collate(samples, 0)
            mask = batch.response_mask.bool()
            trainer, _ = ray.get(actor.compute_logprobs.remote(batch))
            base, _ = ray.get(actor.compute_ref_logprobs.remote(batch))
            served = batch.rollout_logprobs[mask]
            mismatch = float((trainer[mask] - served).abs().max())
            assert mismatch < 5e-4, f"sync {version}: rollout log-probs differ from the trainer's by {mismatch}"
            assert float((base[mask] - served).abs().max()) > 1e-2, f"sync {version}: the rollout still serves the base"
            torch.testing.assert_close(batch.ref_logprobs[mask], base[mask], atol=5e-4, rtol=0)
            assert float((batch.ref_logprobs[mask] - trainer[mask]).abs().max()) > 1e-2, (
                "the reference follows the policy"
            )
        assert ray.get(rollout.__ray_call__.remote(lambda w: w.ref_model is None)), "a second model for the reference"
    finally:
        for h in (actor, rollout):
            ray.kill(h)


# ------------------------------------------------------------------ a run end to end
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("ref_on_rollout", [False, True], ids=["ref-on-trainer", "ref-on-rollout"])
def test_tiny_lora_run(tmp_path, ray_session, ref_on_rollout):
    """A synchronous tiny LoRA run: the rollout serves the trainer's policy at every step
    (mismatch ~0), the policy moves away from the reference (KL > 0), and no reference role starts."""
    from offstep.pipeline.controller import train

    history = train(
        load_config(
            [
                "preset=tiny",
                "actor.lora.rank=8",
                "actor.optim.lr=0.02",
                "trainer.total_steps=3",
                "pipeline.max_staleness=0",
                f"pipeline.ref_on_rollout={str(ref_on_rollout).lower()}",
                f"trainer.output_dir={tmp_path}",
                "trainer.progress=off",
                "trainer.val_before_train=false",
            ]
        )
    )
    assert [m["step"] for m in history] == [1, 2, 3]
    for m in history:
        assert abs(m["actor/mismatch_kl_k3"]) < 1e-5, m["step"]
    assert history[-1]["actor/kl"] > 1e-5
