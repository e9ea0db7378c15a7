"""verl's reward functions by data source (``default_compute_score`` in verl's
``verl/utils/reward_score/__init__.py``): offstep's built-in scorers give verl's scores on
hand-picked responses. Each expected value was worked out from verl's code (0.9 releases; the
``math_dapo``, ``math_reward``, ``prime_math``, ``geo3k`` with MathRuler's grader, ``gsm8k`` and
``search_r1_like_qa_em`` modules) and checked against those functions run on the same inputs."""

import pytest

from offstep.data.dataset import PromptRecord, check_rule_ground_truths
from offstep.errors import DatasetError
from offstep.rewards.math_grade import grade_answer, latex_to_text, math_equal
from offstep.rewards.registry import RewardFunction
from offstep.rewards.sources import builtin_scorer, unscored_sources

# (solution_str, ground_truth, verl's score); DAPO's: (score, pred)
# GSM8K: strict "#### N" in the last 300 characters, compared as a string; no format score.
# MATH (lighteval): the last \boxed{} (or "\boxed 5" up to a $), Hendrycks' normalisation:
# \frac12 == \frac{1}{2} == 0.5 == 1/2, "x = 5" -> "5", units after "\text{ " and % dropped;
# \fbox or an unclosed box scores 0.
# DAPO: the last "Answer:" line in the last 300 characters, Minerva's normalisation; -1 when wrong
# or missing (a \boxed{} answer alone does not count in verl 0.9).
# PRIME (numina_*): "the answer is" / \boxed / "x =" extraction, the PRM800K grader then PRIME's
# math_equal: 2\sqrt{2} == \sqrt{8} in sympy, 50% == 0.5, but an unreduced 2/4 != 1/2 and
# 0.3333 != 1/3 (a rational answer is not rounded), (2, 1) != (1,2).
# GEO3K: 0.9 * accuracy (MathRuler's grader of the last \boxed{}) + 0.1 * format (<think>..</think>..\boxed{}).
# SEARCH_R1: the last <answer>..</answer>, SQuAD-normalised, against any target; a quarter score
# with more than 10 answer tags.
GSM8K = [
    ('So she has 18 eggs.\n#### 18', '18', 1.0),
    ('The total is #### 1,234', '1234', 1.0),
    ('#### 17', '18', 0.0),
    ('the answer is 18', '18', 0.0),
    ("#### 18\n" + "x" * 300, '18', 0.0),
    ('#### -3.5', '-3.5', 1.0),
]
MATH = [
    ('so $\\boxed{\\frac{1}{2}}$', '\\frac12', 1.0),
    ('so $\\boxed{0.5}$', '\\frac{1}{2}', 1.0),
    ('thus \\boxed{3/4}.', '\\frac{3}{4}', 1.0),
    ('so \\boxed{\\dfrac{3}{4}}', '\\frac{3}{4}', 1.0),
    ('so \\boxed{x = 5}', '5', 1.0),
    ('the answer is 5', '5', 0.0),
    ('first \\boxed{4} then \\boxed{5}', '5', 1.0),
    ('we get $\\boxed 5$ done', '5', 1.0),
    ('result \\fbox{5}', '5', 0.0),
    ('so \\boxed{10\\%}', '10', 1.0),
    ('so \\boxed{90^\\circ}', '90', 1.0),
    ('so \\boxed{\\sqrt2}', '\\sqrt{2}', 1.0),
    ('so \\boxed{\\left( 1, 2 \\right)}', '(1,2)', 1.0),
    ('so \\boxed{6}', '5', 0.0),
    ('so \\boxed{5', '5', 0.0),
    ('so \\boxed{\\text{(C)}}', '\\text{(C)}', 1.0),
    ('so \\boxed{5 \\text{ cm}}', '5', 1.0),
]
DAPO = [
    ('Some reasoning.\nAnswer: 42', '42', (1.0, '42')),
    ('Answer: 41', '42', (-1.0, '41')),
    ('The result is \\boxed{42}', '42', (-1.0, '[INVALID]')),
    ('answer : $1,000$', '1000', (1.0, '1000')),
    ('Answer: x = \\frac12', '\\frac{1}{2}', (1.0, '\\frac{1}{2}')),
    ('Answer: 12 degrees', '12', (1.0, '12')),
    ('Answer: 3\nAnswer: 4', '4', (1.0, '4')),
    ('Answer: \\text{(B)}', 'B', (-1.0, '(B)')),
    ("Answer: 7" + "." * 400, '7', (-1.0, '[INVALID]')),
    ('Answer: \\sqrt3', '\\sqrt{3}', (1.0, '\\sqrt{3}')),
]
PRIME = [
    ('The answer is \\boxed{\\frac{1}{2}}', '0.5', 1.0),
    ('Thus the answer is $\\boxed{2\\sqrt{2}}$.', '\\sqrt{8}', 1.0),
    ('So x = 3.', '3', 1.0),
    ('The answer is 1,000', '1000', 1.0),
    ('The answer is \\boxed{(1, 2)}', '(1,2)', 1.0),
    ('The answer is \\boxed{(2, 1)}', '(1,2)', 0.0),
    ('The answer is \\boxed{2/4}', '\\frac{1}{2}', 0.0),
    ('The answer is \\boxed{50\\%}', '0.5', 1.0),
    ('The answer is \\boxed{4}', '5', 0.0),
    ('We get \\boxed{x^2+2x+1}', '(x+1)^2', 1.0),
    ('The answer is \\boxed{2\\pi}', '6.2832', 1.0),
    ('I do not know', '7', 0.0),
    ('The answer is \\boxed{\\text{B}}', 'B', 1.0),
    ('The final answer is 12 cm', '12', 1.0),
    ('the answer is \\boxed{3.0}', '3', 1.0),
    ('the answer is \\boxed{0.3333}', '\\frac{1}{3}', 0.0),
    ('The answer is \\boxed{\\frac{\\sqrt{3}}{2}}', '\\frac{\\sqrt3}{2}', 1.0),
    ('The answer is \\boxed{[1, 2)}', '[1,2)', 1.0),
    ('The answer is \\boxed{\\infty}', '\\infty', 1.0),
    ('The answer is \\boxed{3 \\cdot 4}', '12', 0.0),
    ('The answer is \\boxed{\\frac{\\pi}{2}}', '\\frac{\\pi}{2}', 1.0),
    ('The answer is \\boxed{1, 2, 3}', '1,2,3', 1.0),
    ('The answer is \\boxed{101_2}', '5', 0.0),
    ('Hence the answer is $x=\\frac{7}{3}$', '\\frac{7}{3}', 1.0),
    ('The answer is \\boxed{2 million}', '2000000', 0.0),
    ('The answer is \\boxed{7 \\frac{3}{4}}', '\\frac{31}{4}', 1.0),
]
GEO3K = [
    ('<think>angles sum</think> The answer is \\boxed{60}', '60', 1.0),
    ('The answer is \\boxed{60}', '60', 0.9),
    ('<think>x</think> \\boxed{50}', '60', 0.1),
    ('<think>x</think> no box', '60', 0.0),
    ('<think>x</think> \\boxed{2\\sqrt{3}}', '\\sqrt{12}', 1.0),
    ('<think>x</think> \\boxed{\\frac{3}{2}}', '1.5', 1.0),
    ('\\boxed{12 cm}', '12', 0.9),
    ('<think>x</think> \\boxed{\\frac{\\sqrt{3}}{2}}', '\\frac{\\sqrt{3}}{2}', 1.0),
    ('<think>x</think> \\boxed{50\\%}', '50', 1.0),
]
SEARCH_R1 = [
    ('<think>search</think><answer>The Eiffel Tower</answer>', {'target': ['eiffel tower']}, 1.0),
    ('<answer>Paris</answer>', {'target': ['London', 'Paris, France']}, 0.0),
    ('<answer>Paris, France.</answer>', {'target': ['London', 'Paris, France']}, 1.0),
    ('Paris', {'target': ['Paris']}, 0.0),
    ('<answer>Rome</answer> then <answer> paris </answer>', {'target': ['Paris']}, 1.0),
    ("<answer>x</answer>" * 11 + "<answer>Paris</answer>", {'target': ['Paris']}, 0.25),
    ('<answer>Paris</answer>', {'target': 'paris'}, 1.0),
]

SOURCES = {
    "openai/gsm8k": GSM8K,
    "lighteval/MATH": MATH,
    "DigitalLearningGmbH/MATH-lighteval": MATH,
    "HuggingFaceH4/MATH-500": MATH,
    "numina_olympiads": PRIME,
    "numina_cn_k12": PRIME,
    "hiyouga/geometry3k": GEO3K,
    "searchR1_nq": SEARCH_R1,
    "searchR1_hotpotqa": SEARCH_R1,
}
DAPO_SOURCES = ["math_dapo", "math", "math_dapo_reasoning", "aime24", "aime_2025"]


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_scores_equal_verls(source):
    fn = builtin_scorer(source)
    got = [fn(source, sol, gt) for sol, gt, _ in SOURCES[source]]
    assert got == [pytest.approx(want) for _, _, want in SOURCES[source]]


@pytest.mark.parametrize("source", DAPO_SOURCES)
def test_dapo_scores_equal_verls(source):
    fn = builtin_scorer(source)
    for sol, gt, (score, pred) in DAPO:
        assert fn(source, sol, gt) == {"score": score, "acc": score == 1.0, "pred": pred}, sol


def test_dapo_acc_is_reported_as_an_extra_metric():
    # verl's math_dapo returns {"score", "acc", "pred"}: the numeric acc becomes a metric, the
    # string pred is dropped
    rf = RewardFunction()
    assert rf("math_dapo", "Answer: 42", "42") == (1.0, {"acc": 1.0})
    assert rf("aime24", "no answer", "42") == (-1.0, {"acc": 0.0})


def test_every_verl_source_has_a_scorer():
    verl_sources = [
        *SOURCES,
        *DAPO_SOURCES,
        "numina_aops_forum",
        "numina_synthetic_math",
        "numina_amc_aime",
        "numina_synthetic_amc",
        "searchR1_triviaqa",
        "searchR1_popqa",
        "searchR1_2wikimultihopqa",
        "searchR1_musique",
        "searchR1_bamboogle",
        "codecontests",
        "apps",
        "codeforces",
        "taco",
    ]
    assert unscored_sources(verl_sources) == []
    RewardFunction().check_sources(verl_sources)
    # verl raises NotImplementedError for a source it does not route (livecodebench among them): so does offstep
    other = unscored_sources(["livecodebench", "apps", "my/task", "openai/gsm8k"])
    assert len(other) == 2 and "'livecodebench'" in other[0] and "'my/task'" in other[1]
    assert all("reward.custom_path=" in m and "compute_score" in m for m in other)
    assert unscored_sources(["livecodebench"], custom_path="/x/score.py") == []


def test_latex_to_text_writes_what_pylatexenc_writes():
    # pylatexenc 2.10's LatexNodes2Text, then verl's replacements (sqrt, pi, *, inf)
    assert latex_to_text("\\frac{x+1}{2}") == "x+1/2"  # no brackets, as pylatexenc
    assert latex_to_text("2\\sqrt{3}") == "2sqrt(3)"
    assert latex_to_text("\\sqrt[3]{8}") == "sqrt(8)"  # the degree is dropped
    assert latex_to_text("\\left(1,2\\right)") == "(1,2)"
    assert latex_to_text("a \\cdot b") == "a *b"
    assert latex_to_text("10^{3}\\%") == "10^3%"
    assert latex_to_text("\\text{cm}") == "cm"


def test_no_code_is_evaluated():
    # verl's fallback hands such strings to eval/parse_expr; here they are only compared as text
    evil = "exec('raise SystemExit(3)')"
    assert not math_equal(evil, "0") and not math_equal("0", evil)
    assert not grade_answer(evil, "0")
    prime = builtin_scorer("numina_olympiads")
    assert prime("numina_olympiads", "The answer is \\boxed{__import__('os').getpid()}", "0") == 0.0
    assert not math_equal("9^9^9^9", "1")  # an exponent tower is not evaluated
    assert math_equal("2\\pi", "6.2832") and math_equal("(x+1)**2", "x**2 + 2*x + 1")


def _record(source, truth, missing=False):
    return PromptRecord(
        index=0,
        data_source=source,
        messages=[{"role": "user", "content": "q"}],
        ground_truth=truth,
        data_source_missing=missing,
    )


def test_search_r1_rows_take_a_target_dict():
    check_rule_ground_truths([_record("searchR1_nq", {"target": ["Paris", "paris, france"]})], "d.parquet")
    check_rule_ground_truths([_record("searchR1_nq", {"target": "Paris"})], "d.parquet")
    with pytest.raises(DatasetError, match="target"):
        check_rule_ground_truths([_record("searchR1_nq", "Paris")], "d.parquet")
    check_rule_ground_truths([_record("aime24", "42", missing=True)], "aime24.parquet")  # the stem routes it


def _parquet(path, sources):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {
        "prompt": [[{"role": "user", "content": "q"}]] * len(sources),
        "reward_model": [{"style": "rule", "ground_truth": "1"}] * len(sources),
    }
    if sources is not None:
        rows["data_source"] = sources
    pq.write_table(pa.table(rows), path)
    return str(path)


def test_cfg_refuses_data_sources_without_a_scorer(tmp_path):
    # `offstep train --cfg` and training both call validate, before any worker starts
    from offstep.launch.loader import ConfigError, load_config
    from offstep.launch.preflight import read_data_sources, validate

    train = _parquet(tmp_path / "train.parquet", ["lighteval/MATH", "math_dapo", "my/task", None])
    val = tmp_path / "val.jsonl"
    val.write_text('{"data_source": "aime24"}\n{"data_source": "livecodebench"}\n{"data_source": "codecontests"}\n')
    # a row without a data_source is left to data preparation, which names the row and the fix
    assert read_data_sources(train) == {"lighteval/MATH", "math_dapo", "my/task"}
    assert read_data_sources(str(val)) == {"aime24", "livecodebench", "codecontests"}
    cfg = load_config(["preset=tiny", f"data.train_files=[{train}]", f"data.val_files=[{val}]"])
    with pytest.raises(ConfigError) as info:
        validate(cfg, cpu_count=2, gpu_count=0)
    msg = str(info.value)
    for source in ("'my/task'", "'livecodebench'"):
        assert source in msg
    assert "'math_dapo'" not in msg and "'aime24'" not in msg and "'lighteval/MATH'" not in msg
    assert "'codecontests'" not in msg  # scored in the sandbox, which starts here
    assert msg.count("reward.custom_path=") == 2 and "compute_score" in msg

    scorer = tmp_path / "score.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    validate(
        load_config(
            ["preset=tiny", f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"reward.custom_path={scorer}"]
        ),
        cpu_count=2,
        gpu_count=0,
    )
    ok = _parquet(tmp_path / "ok.parquet", ["openai/gsm8k", "numina_olympiads"])
    validate(load_config(["preset=tiny", f"data.train_files=[{ok}]"]), cpu_count=2, gpu_count=0)
