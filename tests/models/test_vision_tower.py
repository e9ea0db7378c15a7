"""A vision-language model's vision tower under training (the tiny random Qwen2-VL, ``model.path=tiny_vl``):
``actor.freeze_vision_tower`` leaves it without gradients and optimizer state, unchanged by an update and
out of the checkpoint, while the weight sync still carries it and an export still writes it; LoRA's
adapters go on the language model's layers only (the default target modules included, also on
Qwen2.5-VL, whose vision blocks have ``gate_proj``/``up_proj``/``down_proj`` as its language model does)."""

from __future__ import annotations

import pytest
import torch
from test_vision import _png, _prompts, vl  # noqa: F401 (a fixture)

from offstep.batch import Sample, collate
from offstep.config.schema import ActorConfig, AlgorithmConfig, LoRAConfig
from offstep.models.lora import adapter_parameters, add_adapters, target_problems
from offstep.models.vision import pixel_inputs
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.types import SamplingParams

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def spec():
    from offstep.train.distributed import GroupSpec

    yield GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _image_batch(vl):  # noqa: F811
    """Two image prompts, two samples each, from the engine, collated with their images and advantages."""
    path, tok, model, eos, ip = vl
    enc = _prompts(vl, [("<image>How many?", [_png((56, 56), 2)]), ("<image>Count them.", [_png((84, 56), 3)])])
    pics = [pixel_inputs(ip, p.images) for p in enc]
    engine = TorchEngine(model, tok, eos, max_batch_size=8)
    out = engine.generate([p.prompt_ids for p in enc], SamplingParams(n=2, max_new_tokens=8), seed=1, images=pics)
    samples = [
        Sample(c.prompt_index, enc[c.prompt_index].prompt_ids, c.response_ids, c.logprobs, c.finish_reason, 0.0, 0)
        for c in out
    ]
    batch = collate(samples, engine.pad_id)
    batch.images = dict(enumerate(pics))
    batch.advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]) * batch.response_mask
    return batch


def _full(p) -> torch.Tensor:
    return p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()


def test_a_frozen_tower_gets_no_gradient_and_no_optimizer_state_and_stays(vl, spec, tmp_path):  # noqa: F811
    from offstep.config.schema import to_yaml
    from offstep.errors import ConfigError
    from offstep.launch.loader import load_config
    from offstep.models.loading import load_causal_lm, resolve_model
    from offstep.pipeline.checkpoints import Checkpoints, TrainerState, check_compatible
    from offstep.pipeline.export import export_checkpoint
    from offstep.train.actor import ActorWorker
    from offstep.train.checkpoint import SafeReader, save_role

    batch = _image_batch(vl)
    cfg = ActorConfig(micro_batch_size=4, freeze_vision_tower=True)
    actor = ActorWorker(spec, 0, str(resolve_model("tiny_vl")), "float32", "float32", cfg, AlgorithmConfig(), 1.0)
    named = dict(actor.model.named_parameters())
    tower = {n for n in named if ".visual." in n}
    assert tower and all(not named[n].requires_grad for n in tower)
    assert all(p.requires_grad for n, p in named.items() if n not in tower)
    before = {n: _full(p) for n, p in named.items()}
    metrics, _ = actor.update(batch)
    assert metrics["grad_norm"] > 0
    assert all(named[n].grad is None for n in tower), "the tower gets no gradient"
    in_optimizer = {id(p) for g in actor.opt.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in named.items() if n not in tower}
    assert {id(p) for p in actor.opt.state} <= in_optimizer and actor.opt.state, "no optimizer state for the tower"
    after = {n: _full(p) for n, p in named.items()}
    assert all(torch.equal(before[n], after[n]) for n in tower), "the tower is unchanged"
    changed = [n for n in named if n not in tower and not torch.equal(before[n], after[n])]
    assert any(".language_model." in n for n in changed), "the language model trains"
    # the weight sync carries every weight (the tower's unchanged): the engine takes it whole
    sd = actor.full_state_dict(actor.model)
    assert any(".visual." in n for n in sd)
    path, tok, model, eos, _ = vl
    engine = TorchEngine(type(model)(model.config), tok, eos)
    engine.load_weights(sd, 1)
    # the checkpoint holds what trains, the tower not; the export takes the tower from the base model
    ck = Checkpoints(tmp_path / "run")
    staging = ck.staging(1)
    save_role(staging / "actor", 0, actor.model, actor.opt)
    keys = SafeReader(staging / "actor").read_metadata().state_dict_metadata
    assert not [k for k in keys if ".visual." in k]
    assert any(k.startswith("model.model.language_model.") for k in keys), sorted(keys)[:5]
    saved = to_yaml(load_config(["preset=tiny_vl", "actor.freeze_vision_tower=true"]))
    ck.commit(staging, TrainerState(1, 1, 0.0, {"epoch": 0, "position": 0}, [], 0), saved)
    exported = load_causal_lm(str(export_checkpoint(tmp_path / "run", tmp_path / "out")))
    for n, p in exported.state_dict().items():
        assert torch.equal(p, sd[n]), n
    with pytest.raises(ConfigError, match="actor.freeze_vision_tower: checkpoint True, now False"):
        check_compatible(saved, load_config(["preset=tiny_vl"]))


def test_lora_adapts_the_language_model_only(vl):  # noqa: F811
    model = vl[2]
    peft_model = add_adapters(type(model)(model.config), LoRAConfig(rank=4))
    names = [n for n, _ in adapter_parameters(peft_model)]
    assert names and all(".language_model.layers." in n for n in names), names[:4]
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trained == names, "the base, vision tower included, is frozen"
    assert target_problems(model, LoRAConfig(rank=4)) == []
    (problem,) = target_problems(model, LoRAConfig(rank=4, target_modules=["q_proj", "qkv"]))
    assert "'qkv' matches no linear layer of the language model (the vision tower gets no adapters)" in problem


def test_lora_leaves_a_qwen2_5_vl_tower_alone_though_its_blocks_share_the_names():
    """Qwen2.5-VL's vision blocks have gate_proj, up_proj and down_proj: the default targets would match them."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    text.update(num_key_value_heads=1, vocab_size=128, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0]
    )
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))
    tower = [n for n, m in model.named_modules() if ".visual." in n and isinstance(m, torch.nn.Linear)]
    assert any(n.endswith(".mlp.gate_proj") for n in tower), tower
    names = [n for n, _ in adapter_parameters(add_adapters(model, LoRAConfig(rank=4)))]
    assert names and not [n for n in names if ".visual." in n]
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} == set(LoRAConfig().target_modules)
