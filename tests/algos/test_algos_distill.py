"""offstep.algos.distill by hand: a 2-sample, 3-token example worked in the comments."""

import math

import torch

from offstep.algos.distill import distill_advantages, distill_metrics, reverse_kl_per_token, topk_forward_kl

# Sample 0: 3 response tokens.      student log-probs [-1.0, -0.5, -2.0], teacher [-0.5, -0.5, -3.0]
# Sample 1: 2 tokens and a pad.     student [-0.2, -1.5, pad],            teacher [-1.2, -0.5, pad]
STUDENT = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, 0.0]])
TEACHER = torch.tensor([[-0.5, -0.5, -3.0], [-1.2, -0.5, -7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_reverse_kl_per_token_is_student_minus_teacher_on_the_mask():
    # s - t: sample 0 [-1.0+0.5, -0.5+0.5, -2.0+3.0] = [-0.5, 0.0, 1.0]; sample 1 [1.0, -1.0, (pad) 0]
    want = torch.tensor([[-0.5, 0.0, 1.0], [1.0, -1.0, 0.0]])
    assert torch.allclose(reverse_kl_per_token(STUDENT, TEACHER, MASK), want)


def test_pure_distillation_advantage_is_teacher_minus_student():
    # no task reward: A = t - s = [[0.5, 0.0, -1.0], [-1.0, 1.0, 0]]
    want = torch.tensor([[0.5, 0.0, -1.0], [-1.0, 1.0, 0.0]])
    assert torch.allclose(distill_advantages(None, STUDENT, TEACHER, MASK), want)


def test_distillation_added_to_the_task_advantage_with_a_weight():
    # GRPO over the two samples gave sample 0 +0.7 and sample 1 -0.7 on every token; coef 0.5:
    # sample 0: 0.7 + 0.5 * [0.5, 0.0, -1.0] = [0.95, 0.7, 0.2]
    # sample 1: -0.7 + 0.5 * [-1.0, 1.0] = [-1.2, -0.2], the pad 0
    task = torch.tensor([[0.7, 0.7, 0.7], [-0.7, -0.7, -0.7]])
    want = torch.tensor([[0.95, 0.7, 0.2], [-1.2, -0.2, 0.0]])
    assert torch.allclose(distill_advantages(task, STUDENT, TEACHER, MASK, coef=0.5), want)


def test_a_teacher_equal_to_the_student_gives_zero_advantages():
    assert torch.equal(distill_advantages(None, STUDENT, STUDENT.clone(), MASK), torch.zeros(2, 3))


def test_the_clamp_bounds_an_all_but_impossible_token():
    # teacher -30 and student -1 at the clamp -10: s - t = -1 - (-10) = 9, so A = -9 (not -29)
    adv = distill_advantages(
        None, torch.tensor([[-1.0]]), torch.tensor([[-30.0]]), torch.ones(1, 1), log_prob_min_clamp=-10.0
    )
    assert adv.item() == -9.0


def test_metrics_are_means_over_the_response_tokens():
    # reverse KL: (-0.5 + 0 + 1 + 1 - 1) / 5 = 0.1; teacher: (-0.5 - 0.5 - 3 - 1.2 - 0.5) / 5 = -1.14
    kl, teacher = distill_metrics(STUDENT, TEACHER, MASK)
    assert math.isclose(kl, 0.1, abs_tol=1e-6) and math.isclose(teacher, -1.14, abs_tol=1e-6)
    assert distill_metrics(STUDENT, TEACHER, torch.zeros(2, 3)) == (0.0, 0.0)


def test_topk_forward_kl_by_hand():
    # one position; the teacher's top-2 probabilities 0.5, 0.25, renormalised over the two: 2/3, 1/3;
    # the student's on those ids 0.25, 0.5, renormalised: 1/3, 2/3.
    # KL = 2/3 ln((2/3)/(1/3)) + 1/3 ln((1/3)/(2/3)) = 2/3 ln 2 - 1/3 ln 2 = 1/3 ln 2
    t = torch.tensor([[[math.log(0.5), math.log(0.25)]]])
    s = torch.tensor([[[math.log(0.25), math.log(0.5)]]])
    got = topk_forward_kl(t, s, torch.ones(1, 1))
    assert math.isclose(got.item(), math.log(2) / 3, rel_tol=1e-6)
    # a slot the teacher left empty (-inf) counts on neither side; a masked position is 0
    t3 = torch.cat([t, torch.full((1, 1, 1), -math.inf)], -1)
    s3 = torch.cat([s, torch.full((1, 1, 1), -0.1)], -1)
    assert math.isclose(topk_forward_kl(t3, s3, torch.ones(1, 1)).item(), math.log(2) / 3, rel_tol=1e-6)
    assert topk_forward_kl(t3, s3, torch.zeros(1, 1)).item() == 0.0


def test_topk_forward_kl_is_zero_with_zero_gradient_at_equality():
    # the student's log-probs on the ids may differ from the teacher's by a constant (other mass
    # elsewhere): renormalised over the ids they are equal, so the term and its gradient are 0
    t = torch.tensor([[[math.log(0.5), math.log(0.25)]]])
    s = (t - 1.0).clone().requires_grad_(True)
    kl = topk_forward_kl(t, s, torch.ones(1, 1))
    kl.sum().backward()
    assert abs(kl.item()) < 1e-7 and s.grad.abs().max().item() < 1e-7


def test_topk_forward_kl_gradient_by_hand():
    # d/ds_k = softmax(s)_k - t~_k. s = [-1, -2]: softmax = [e^-1, e^-2] / (e^-1 + e^-2) = [0.7311, 0.2689];
    # t~ = [2/3, 1/3]: the gradient is [0.7311 - 0.6667, 0.2689 - 0.3333] = [0.0644, -0.0644]
    t = torch.tensor([[[math.log(0.5), math.log(0.25)]]])
    s = torch.tensor([[[-1.0, -2.0]]], requires_grad=True)
    topk_forward_kl(t, s, torch.ones(1, 1)).sum().backward()
    p = math.exp(-1) / (math.exp(-1) + math.exp(-2))
    assert torch.allclose(s.grad, torch.tensor([[[p - 2 / 3, (1 - p) - 1 / 3]]]), atol=1e-6)


def test_topk_forward_kl_position_without_ids_is_zero_with_finite_gradients():
    # a padded position (every slot -inf, as collate leaves it) next to a real one
    t = torch.tensor([[[math.log(0.5), math.log(0.25)], [-math.inf, -math.inf]]])
    s = torch.tensor([[[-1.0, -2.0], [-3.0, -0.5]]], requires_grad=True)
    kl = topk_forward_kl(t, s, torch.tensor([[1.0, 1.0]]))
    kl.sum().backward()
    assert kl[0, 1].item() == 0.0 and torch.isfinite(s.grad).all() and s.grad[0, 1].abs().max().item() == 0.0
