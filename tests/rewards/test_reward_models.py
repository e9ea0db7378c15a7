"""Rewards from models (reward.model; docs/reward-models.md): a discriminative reward model's
score against a direct transformers forward, the judge's parsers, the combining maths, the
fallback on a timeout or a failure, and the rollout worker scoring with a model."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from conftest import needs_vllm

from offstep.config.schema import RewardModelConfig
from offstep.errors import RewardError
from offstep.rewards.combine import FALLBACK, MODEL, RULE, Combination, ModelScore, SampleReward, combine
from offstep.rewards.judge import parse_score, render_judge_prompt
from offstep.rewards.registry import RewardFunction
from offstep.rollout.scoring.replica_reward_model import (
    DiscriminativeScorer,
    Item,
    JudgeScorer,
    ModelBatcher,
    render_chat,
)
from tests.reward_model_helpers import build_classifier

CPU = torch.device("cpu")
CHATS = [
    Item([{"role": "user", "content": "What is 2 + 3?"}], "It is 5."),
    Item(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "Hello there, how are you today?",
    ),
    Item([{"role": "user", "content": "7 * 6?"}], "42"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_discriminative_score_is_a_direct_forward_on_the_rendered_chat(tmp_path, tiny, arch):
    _, tok, _, _ = tiny
    folder = build_classifier(tmp_path / arch, arch, tok)
    scorer = DiscriminativeScorer(RewardModelConfig(kind="discriminative", path=str(folder)), CPU)
    batched = scorer(CHATS)  # one padded batch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ref_tok = AutoTokenizer.from_pretrained(folder)
    ref = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    for item, got in zip(CHATS, batched):
        text = ref_tok.apply_chat_template(
            [*item.prompt, {"role": "assistant", "content": item.response}], tokenize=False
        )
        assert text == render_chat(scorer.tok, item.prompt, item.response)
        assert text.endswith(f"<|im_start|>assistant\n{item.response}<|im_end|>\n")  # the RM's own (ChatML) template
        with torch.no_grad():
            want = ref(**ref_tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
        assert got == pytest.approx(want, abs=1e-5)
    assert len({round(v, 4) for v in batched}) == 3  # different chats, different scores


@pytest.mark.parametrize(
    "text, parser, want",
    [
        ("Score: 0.8", "last_number", 0.8),
        ("between 0 and 1, I say 1", "last_number", 1.0),
        ("7 out of 10", "last_number", None),  # 10 is the last number, outside [0, 1]
        ("no number here", "last_number", None),
        ("Yes. It is right.", "yes_no", 1.0),
        ("NO, not yes", "yes_no", 0.0),  # the first of them
        ("yesterday nothing", "yes_no", None),  # whole words only
        ("Rating: 7/10", r"regex:Rating: (\d+)/10", 7.0),
        ("Rating: seven", r"regex:Rating: (\w+)", None),  # the group is not a number
        ("nothing", r"regex:Rating: (\d+)", None),
    ],
)
def test_parsers(text, parser, want):
    assert parse_score(text, parser) == want


def test_judge_prompt_template():
    assert render_judge_prompt("Q={question} R={response} T={ground_truth}", "2+3?", "5", 5) == "Q=2+3? R=5 T=5"
    # a named template (reward.model.template=yes_no) is its text; an unknown word is a template of its own
    assert render_judge_prompt("yes_no", "2+3?", "6", 5) == (
        "Question: 2+3?\nReference answer: 5\nResponse: 6\nDoes the response give the reference answer? Answer yes or no."
    )
    assert render_judge_prompt("score", "q", "r", 1).endswith("Answer with a score between 0 and 1.")
    assert render_judge_prompt("yesno", "q", "r", 1) == "yesno"


@pytest.mark.parametrize(
    "rule, model, mode, w, rw, want",
    [
        (1.0, 0.25, "weighted", 1.0, 0.0, 0.25),  # the model alone: 1 * 0.25
        (1.0, 0.25, "weighted", 0.5, 2.0, 2.125),  # 2 * 1 + 0.5 * 0.25 = 2.125
        (0.0, -1.5, "weighted", 2.0, 1.0, -3.0),  # 1 * 0 + 2 * -1.5 = -3
        (None, 0.5, "weighted", 1.0, 0.0, 0.5),  # no rule needed with rule_weight 0
        (0.0, None, "abstain", 1.0, 0.0, 0.0),  # the rule judged: its score, even 0
        (None, 0.75, "abstain", 1.0, 0.0, 0.75),  # the rule abstained: the model's
    ],
)
def test_combine_hand_worked(rule, model, mode, w, rw, want):
    assert combine(rule, model, mode, w, rw) == pytest.approx(want)


def test_sample_reward_logs_each_component_and_asks_the_model_only_where_needed(tmp_path):
    asked = []

    def model(prompt, response, ground_truth):
        asked.append(response)
        return ModelScore(0.5) if response != "slow" else ModelScore(None, "timeout")

    rule = RewardFunction()  # arithmetic: 1 if the last number equals the ground truth
    weighted = SampleReward(rule, model, Combination("weighted", weight=2.0, rule_weight=1.0, fallback_score=-1.0))
    assert weighted("arithmetic", "= 12", "12", {}, prompt=[]) == (
        2.0,
        {RULE: 1.0, MODEL: 0.5, FALLBACK: 0.0},
    )  # 1 + 2 * 0.5
    assert weighted("arithmetic", "slow", "12", {}) == (-2.0, {RULE: 0.0, MODEL: -1.0, FALLBACK: 1.0})  # 0 + 2 * -1
    alone = SampleReward(rule, model, Combination("weighted", 1.0, 0.0, 0.0, needs_rule=False))
    assert alone("no-such-source", "x", None, {}) == (0.5, {MODEL: 0.5, FALLBACK: 0.0})  # no scorer: no rule component

    scorer = tmp_path / "r.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return None if 'proof' in solution_str else 1.0\n"
    )
    abstaining = SampleReward(RewardFunction(str(scorer), abstain=True), model, Combination("abstain", needs_rule=True))
    asked.clear()
    assert abstaining("d", "a proof", "g", {}) == (0.5, {MODEL: 0.5, FALLBACK: 0.0})
    assert abstaining("d", "plain", "g", {}) == (1.0, {RULE: 1.0})
    assert asked == ["a proof"]  # the model only where the rule abstained
    with pytest.raises(RewardError, match="non-number NoneType"):  # without abstain a None is still an error
        SampleReward(RewardFunction(str(scorer)))("d", "a proof", "g", {})


def _batcher(fn, batch_size=4, concurrency=8, timeout_s=5.0):
    return ModelBatcher(fn, batch_size, concurrency, timeout_s)


def _in_threads(batcher, n):
    out = [None] * n

    def one(i):
        out[i] = batcher([], f"r{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_batcher_batches_what_waits_and_keeps_each_sample_its_score():
    sizes, gate = [], threading.Event()

    def score(items):
        gate.wait(5)  # the first batch holds until the others queue behind it
        sizes.append(len(items))
        return [float(it.response[1:]) for it in items]

    b = _batcher(score, batch_size=4)
    threads = threading.Thread(target=lambda: results.extend(_in_threads(b, 9)))
    results: list = []
    threads.start()
    time.sleep(0.3)
    gate.set()
    threads.join(30)
    assert sorted(r.value for r in results) == [float(i) for i in range(9)] and all(r.status == "ok" for r in results)
    assert sum(sizes) == 9 and max(sizes) <= 4 and len(sizes) < 9  # batched, never past batch_size
    assert len(b.take_spans()) == len(sizes) and b.take_spans() == ()


def test_a_timeout_or_a_failure_falls_back_and_never_hangs():
    never = threading.Event()
    hung = _batcher(lambda items: never.wait(60) and [], timeout_s=0.3)  # a forward that does not return
    t0 = time.monotonic()
    out = _in_threads(hung, 3)
    assert [r.status for r in out] == ["timeout"] * 3 and all(r.value is None for r in out)
    assert time.monotonic() - t0 < 5
    never.set()

    def broken(items):
        raise RuntimeError("CUDA out of memory (simulated)")

    assert _batcher(broken)([], "x") == ModelScore(None, "failed")
    assert _batcher(lambda items: [None] * len(items))([], "x") == ModelScore(None, "unparsed")
    # the concurrency limit: a second sample waits for the one slot, then times out
    slow = _batcher(lambda items: time.sleep(1.0) or [1.0] * len(items), concurrency=1, timeout_s=0.4)
    first = threading.Thread(target=slow, args=([], "a"))
    first.start()
    time.sleep(0.05)
    assert slow([], "b") == ModelScore(None, "timeout")
    first.join()


def test_judge_scores_with_the_engine_and_parses_its_text(tiny):
    from offstep.rollout.engines.torch_engine import TorchEngine
    from offstep.rollout.types import SamplingParams

    path, tok, model, eos = tiny
    cfg = RewardModelConfig(
        kind="generative",
        path="tiny",
        parser=r"regex:(\S)",
        max_new_tokens=6,
        template="Q: {question} A: {response} Truth: {ground_truth}",
    )
    judge = JudgeScorer(cfg, CPU)
    items = [Item([{"role": "user", "content": "2+3?"}], "5", 5), Item([{"role": "user", "content": "9-4?"}], "6", 5)]
    scores = judge(items)
    ids = judge.prompt_ids(items[0])
    assert tok.decode(ids).endswith("<|im_start|>user\nQ: 2+3? A: 5 Truth: 5<|im_end|>\n<|im_start|>assistant\n")
    direct = TorchEngine(model, tok, eos, device=CPU).generate(
        [judge.prompt_ids(it) for it in items], SamplingParams(n=1, temperature=0.0, max_new_tokens=6), 0
    )
    assert judge.last_texts == [c.text for c in direct]  # greedy, through the engine interface
    assert scores == [parse_score(t, cfg.parser) for t in judge.last_texts]


@needs_vllm
@pytest.mark.own_process
def test_a_judge_on_vllm_answers_as_on_the_builtin_engine():
    """reward.model.engine=vllm: the same judge prompts, answered greedily by vLLM, give the built-in
    engine's texts and so the same scores."""
    items = [Item([{"role": "user", "content": f"{a}+3?"}], str(a + 3), a + 3) for a in range(4)]
    cfg = RewardModelConfig(
        kind="generative",
        path="tiny",
        parser=r"regex:(\S)",
        max_new_tokens=6,
        template="Q: {question} A: {response} Truth: {ground_truth}",
    )
    builtin = JudgeScorer(cfg, CPU)
    on_vllm = JudgeScorer(dataclasses.replace(cfg, engine="vllm"), CPU)
    try:
        assert type(on_vllm.engine).__name__ == "VLLMEngine"
        assert on_vllm(items) == builtin(items)
        assert on_vllm.last_texts == builtin.last_texts
    finally:
        on_vllm.engine.close()


def test_rollout_worker_scores_with_the_reward_model_as_samples_finish(tmp_path, tiny):
    from offstep.rollout.replica_spec import Request, RolloutSpec
    from offstep.rollout.types import SamplingParams
    from offstep.rollout.worker import RolloutWorker

    path, tok, _, _ = tiny
    folder = build_classifier(tmp_path / "rm", "qwen2", tok)
    m = RewardModelConfig(kind="discriminative", path=str(folder), rule_weight=1.0, weight=0.5, batch_size=4)
    worker = RolloutWorker(RolloutSpec.local(path, RewardFunction(), 8, reward_model=m))
    messages = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(3)]
    ids = [
        tok(
            tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        ).input_ids
        for msg in messages
    ]
    requests = [Request(i, ids[i], "arithmetic", str(i + 1), messages=msg) for i, msg in enumerate(messages)]
    samples, timing = worker.generate(requests, SamplingParams(n=2, max_new_tokens=8), seed=0)
    rm = DiscriminativeScorer(m, CPU)
    for s in samples:
        msg = messages[s.uid]
        want = rm([Item(msg, s.text)])[0]
        assert s.reward_extra[MODEL] == pytest.approx(want, abs=1e-5) and s.reward_extra[FALLBACK] == 0.0
        assert s.score == pytest.approx(s.reward_extra[RULE] + 0.5 * want, abs=1e-5)
    assert timing.reward and all(span.end >= span.start for span in timing.reward)


def test_accuracy_is_the_rules_with_a_reward_model():
    """val/acc counts the rule's verdict; val/reward/mean is the combined reward."""
    from offstep.batch import Sample
    from offstep.pipeline.evaluation import summarise

    def sample(score, extra):
        return Sample(
            uid=0,
            prompt_ids=[1],
            response_ids=[2],
            rollout_logprobs=[0.0],
            finish_reason="stop",
            score=score,
            version=0,
            data_source="arithmetic",
            reward_extra=extra,
        )

    samples = [sample(1.7, {RULE: 1.0, MODEL: 0.7}), sample(2.5, {RULE: 0.0, MODEL: 2.5}), sample(0.2, {MODEL: 0.2})]
    m = summarise(samples, prefix="val/")
    assert m["val/acc"] == pytest.approx(1 / 3)  # the rule's 1 and 0, and 0.2 < 1 where no rule scored
    assert m["val/reward/mean"] == pytest.approx((1.7 + 2.5 + 0.2) / 3)
