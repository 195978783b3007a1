"""Tests for lit_smd.losses.kl and kl_topk: exact values, gradient identities, chunked/top-k equivalence, validation."""

import math

import pytest
import torch
from torch import Tensor

from lit_smd.losses.head import OutputHead
from lit_smd.losses.kl import KLOutput, chunked_token_kl, sampled_reverse_kl, token_kl
from lit_smd.losses.kl_topk import topk_token_kl

V, H, H_T = 11, 6, 5
DT = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(*shape: int, seed: int = 0, scale: float = 2.0) -> Tensor:
    return (scale * torch.randn(*shape, V, generator=_gen(seed), dtype=DT)).requires_grad_()


def _linear_problem(n: int = 10, seed: int = 0) -> dict[str, Tensor]:
    """Student hidden/lm_head/bias (requiring grad) plus a teacher with its own hidden size."""
    g = _gen(seed)
    return {
        "hidden": torch.randn(n, H, generator=g, dtype=DT).requires_grad_(),
        "weight": torch.randn(V, H, generator=g, dtype=DT).requires_grad_(),
        "bias": torch.randn(V, generator=g, dtype=DT).requires_grad_(),
        "t_hidden": torch.randn(n, H_T, generator=g, dtype=DT),
        "t_weight": torch.randn(V, H_T, generator=g, dtype=DT),
        "t_bias": torch.randn(V, generator=g, dtype=DT),
        "mask": torch.rand(n, generator=g) > 0.3,
    }


def _grads(loss: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad(loss, inputs)


def _manual_kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def test_hand_computed_three_token_vocab():
    p = torch.tensor([0.7, 0.2, 0.1], dtype=DT)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=DT)
    fkl = 0.7 * math.log(0.7 / 0.4) + 0.2 * math.log(0.2 / 0.4) + 0.1 * math.log(0.1 / 0.2)
    rkl = 0.4 * math.log(0.4 / 0.7) + 0.4 * math.log(0.4 / 0.2) + 0.2 * math.log(0.2 / 0.1)
    # Logits are log-probs plus an arbitrary per-row shift.
    student, teacher = (q.log() + 3.0)[None], (p.log() - 1.0)[None]
    assert token_kl(student, teacher).item() == pytest.approx(fkl, abs=1e-14)
    assert token_kl(student, teacher, forward_weight=0, reverse_weight=1).item() == pytest.approx(rkl, abs=1e-14)
    mixed = token_kl(student, teacher, forward_weight=0.8, reverse_weight=0.2).item()
    assert mixed == pytest.approx(0.8 * fkl + 0.2 * rkl, abs=1e-14)
    assert fkl != pytest.approx(rkl)


def test_forward_kl_gradient_equals_soft_target_cross_entropy_gradient():
    student, teacher = _logits(4, 7, seed=1), _logits(4, 7, seed=2)
    mask = torch.rand(4, 7, generator=_gen(3)) > 0.2
    (grad_kl,) = _grads(token_kl(student, teacher, temperature=1.3, mask=mask), student)
    soft_targets = torch.softmax(teacher / 1.3, -1).detach()
    cross_entropy = -(soft_targets * torch.log_softmax(student / 1.3, -1)).sum(-1)
    (grad_ce,) = _grads((cross_entropy * mask).sum() / mask.sum(), student)
    torch.testing.assert_close(grad_kl, grad_ce, rtol=1e-12, atol=1e-14)
    assert teacher.grad is None


@pytest.mark.parametrize("reverse_weight", [1.0, 0.2, 3.0])
@pytest.mark.parametrize("position", range(3))
def test_reverse_kl_gradient_is_expected_sampled_gradient(position: int, reverse_weight: float):
    """In expectation over ``v ~ q`` (enumerated exactly, float64), the sampled estimator's value and gradient are
    those of the full-vocabulary ``reverse_weight * KL(q || p)``."""
    student, teacher = _logits(seed=10 + position), _logits(seed=20 + position).detach()
    full = token_kl(student[None], teacher[None], forward_weight=0, reverse_weight=reverse_weight)
    (exact,) = _grads(full, student)
    log_p = torch.log_softmax(teacher, -1)
    expected, expected_value = torch.zeros_like(student), 0.0
    for v in range(V):  # E_{v ~ q}[value and gradient of the surrogate at v], enumerated over the vocabulary
        log_q = torch.log_softmax(student, -1)
        sampled = sampled_reverse_kl(log_q[v].view(1, 1), log_p[v].view(1, 1), reverse_weight=reverse_weight)
        (grad_v,) = _grads(sampled, student)
        expected += log_q[v].exp().detach() * grad_v
        expected_value += log_q[v].exp().item() * sampled.item()
    torch.testing.assert_close(expected, exact, rtol=1e-10, atol=1e-13)
    assert expected_value == pytest.approx(full.item(), rel=1e-12)


def test_sampled_reverse_kl_value_and_mask():
    g = _gen(4)
    student = torch.randn(3, 5, generator=g, dtype=DT).requires_grad_()
    teacher = torch.randn(3, 5, generator=g, dtype=DT).requires_grad_()
    mask = torch.tensor([[1, 1, 0, 0, 1], [0] * 5, [1] * 5], dtype=torch.bool)
    loss = sampled_reverse_kl(student, teacher, mask)
    torch.testing.assert_close(loss, (student - teacher)[mask].mean())  # value: the k1 estimate
    grad_student, grad_teacher = torch.autograd.grad(loss, (student, teacher), allow_unused=True)
    reward = (teacher - student).detach()
    torch.testing.assert_close(grad_student, -reward * mask / mask.sum())
    assert grad_teacher is None


def test_forward_differs_from_reverse_and_mixed_is_weighted_sum():
    student, teacher = _logits(9, seed=5), _logits(9, seed=6, scale=4.0)
    fkl = token_kl(student, teacher)
    rkl = token_kl(student, teacher, forward_weight=0, reverse_weight=1)
    assert abs(fkl.item() - rkl.item()) > 1e-3
    mixed = token_kl(student, teacher, forward_weight=0.8, reverse_weight=0.2)
    torch.testing.assert_close(mixed, 0.8 * fkl + 0.2 * rkl)
    torch.testing.assert_close(_grads(mixed, student)[0], 0.8 * _grads(fkl, student)[0] + 0.2 * _grads(rkl, student)[0])


def test_temperature_scales_both_logits():
    student, teacher = _logits(2, 4, seed=7), _logits(2, 4, seed=8)
    for tau in (0.5, 2.0):
        scaled = token_kl(student / tau, teacher / tau, forward_weight=0.3, reverse_weight=0.7)
        torch.testing.assert_close(
            token_kl(student, teacher, forward_weight=0.3, reverse_weight=0.7, temperature=tau), scaled
        )
    assert token_kl(student, teacher, temperature=3.0) < token_kl(student, teacher)


def test_identical_distributions_give_zero():
    student = _logits(5, seed=9)
    assert token_kl(student, student + 1.5, forward_weight=1, reverse_weight=1).item() == pytest.approx(0, abs=1e-14)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 10, 64])
@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0), (0.8, 0.2)])
def test_chunked_matches_naive_with_teacher_hidden(chunk_size: int, weights: tuple[float, float]):
    p = _linear_problem()
    wf, wr = weights
    kwargs = {"forward_weight": wf, "reverse_weight": wr, "temperature": 0.7}
    student_logits = p["hidden"] @ p["weight"].T + p["bias"]
    teacher_logits = p["t_hidden"] @ p["t_weight"].T + p["t_bias"]
    naive = token_kl(student_logits, teacher_logits, mask=p["mask"], **kwargs)
    out = chunked_token_kl(
        p["hidden"], OutputHead(p["weight"], p["bias"]), p["t_hidden"],
        teacher_head=OutputHead(p["t_weight"], p["t_bias"]), mask=p["mask"], chunk_size=chunk_size, **kwargs,
    )  # fmt: skip
    assert isinstance(out, KLOutput)
    torch.testing.assert_close(out.loss, naive, rtol=1e-12, atol=1e-14)
    inputs = (p["hidden"], p["weight"], p["bias"])
    for got, want in zip(_grads(out.loss, *inputs), _grads(naive, *inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)
    assert out.num_tokens.item() == p["mask"].sum().item()


@pytest.mark.parametrize("chunk_size", [2, 3, 1024])
def test_chunked_matches_naive_with_teacher_logits_and_batch_shape(chunk_size: int):
    p = _linear_problem(n=12, seed=1)
    hidden = p["hidden"].view(3, 4, H)
    teacher_logits = (p["t_hidden"] @ p["t_weight"].T).view(3, 4, V)
    mask = p["mask"].view(3, 4)
    kwargs = {"forward_weight": 0.5, "reverse_weight": 0.5, "temperature": 1.5, "mask": mask}
    naive = token_kl(hidden @ p["weight"].T, teacher_logits, **kwargs)
    teacher_before = teacher_logits.clone()
    out = chunked_token_kl(hidden, OutputHead(p["weight"]), teacher_logits, chunk_size=chunk_size, **kwargs)
    assert torch.equal(teacher_logits, teacher_before)  # the caller's logits are not scaled in place
    torch.testing.assert_close(out.loss, naive, rtol=1e-12, atol=1e-14)
    for got, want in zip(_grads(out.loss, p["hidden"], p["weight"]), _grads(naive, p["hidden"], p["weight"]),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)


def test_chunked_stats_and_float_weights():
    p = _linear_problem(seed=2)
    weights = torch.rand(10, generator=_gen(5), dtype=DT)
    student_logits = p["hidden"] @ p["weight"].T
    teacher_logits = p["t_hidden"] @ p["t_weight"].T
    out = chunked_token_kl(p["hidden"], OutputHead(p["weight"]), teacher_logits, forward_weight=0.8,
                           reverse_weight=0.2, mask=weights, chunk_size=3)  # fmt: skip
    log_q, log_p = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    fkl, rkl = _manual_kl(log_p, log_q), _manual_kl(log_q, log_p)
    entropy = -(log_q.exp() * log_q).sum(-1)
    mean = lambda x: (weights * x).sum() / weights.sum()  # noqa: E731
    torch.testing.assert_close(out.loss, mean(0.8 * fkl + 0.2 * rkl))
    torch.testing.assert_close(out.forward_kl, mean(fkl))
    torch.testing.assert_close(out.reverse_kl, mean(rkl))
    torch.testing.assert_close(out.student_entropy, mean(entropy))
    torch.testing.assert_close(out.num_tokens, weights.sum())
    assert not any(t.requires_grad for t in out[1:])


def test_chunked_explicit_normalizer():
    p = _linear_problem(seed=3)
    teacher_logits = p["t_hidden"] @ p["t_weight"].T
    head = OutputHead(p["weight"])
    mean = chunked_token_kl(p["hidden"], head, teacher_logits, mask=p["mask"], chunk_size=4)
    summed = chunked_token_kl(p["hidden"], head, teacher_logits, mask=p["mask"], normalizer=1.0)
    scaled = chunked_token_kl(p["hidden"], head, teacher_logits, mask=p["mask"], normalizer=torch.tensor(40.0))
    torch.testing.assert_close(summed.loss, mean.loss * p["mask"].sum())
    torch.testing.assert_close(scaled.loss, summed.loss / 40)
    torch.testing.assert_close(scaled.forward_kl, mean.forward_kl)  # stats stay means over valid tokens


def test_chunked_teacher_gets_no_gradient_even_when_sharing_the_lm_head():
    """SMD: dense teacher and masked student through the same lm_head; only the student side is differentiated."""
    p = _linear_problem(seed=4)
    dense_hidden = torch.randn(10, H, generator=_gen(30), dtype=DT).requires_grad_()  # a teacher that requires grad
    head = OutputHead(p["weight"])
    out = chunked_token_kl(p["hidden"], head, dense_hidden, teacher_head=head, chunk_size=3)
    naive = token_kl(p["hidden"] @ p["weight"].T, (dense_hidden @ p["weight"].T).detach())
    got = torch.autograd.grad(out.loss, (p["hidden"], p["weight"], dense_hidden), allow_unused=True)
    want = _grads(naive, p["hidden"], p["weight"])
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert got[2] is None


def test_chunked_reverse_switch_differentiates_the_other_side():
    """KL(dense || sg[masked]) = reverse direction with the dense pass as the student."""
    p = _linear_problem(seed=5)
    masked_logits = (p["t_hidden"] @ p["t_weight"].T).detach()
    out = chunked_token_kl(
        p["hidden"], OutputHead(p["weight"]), masked_logits, forward_weight=0, reverse_weight=1, chunk_size=4
    )
    dense_logp = torch.log_softmax(p["hidden"] @ p["weight"].T, -1)
    direct = _manual_kl(dense_logp, torch.log_softmax(masked_logits, -1)).mean()
    torch.testing.assert_close(out.loss, direct)
    torch.testing.assert_close(_grads(out.loss, p["hidden"])[0], _grads(direct, p["hidden"])[0])


def test_chunked_frozen_lm_head_and_no_grad():
    p = _linear_problem(seed=6)
    weight = p["weight"].detach()
    teacher_logits = p["t_hidden"] @ p["t_weight"].T
    out = chunked_token_kl(p["hidden"], OutputHead(weight), teacher_logits, chunk_size=4)
    naive = token_kl(p["hidden"] @ weight.T, teacher_logits)
    torch.testing.assert_close(_grads(out.loss, p["hidden"])[0], _grads(naive, p["hidden"])[0])
    with torch.no_grad():
        frozen = chunked_token_kl(p["hidden"], OutputHead(p["weight"]), teacher_logits, chunk_size=4)
    assert not frozen.loss.requires_grad
    torch.testing.assert_close(frozen.loss, naive.detach())


def test_chunked_backward_scales_with_upstream_gradient():
    p = _linear_problem(seed=7)
    teacher_logits = p["t_hidden"] @ p["t_weight"].T
    out = chunked_token_kl(p["hidden"], OutputHead(p["weight"]), teacher_logits, chunk_size=4)
    naive = token_kl(p["hidden"] @ p["weight"].T, teacher_logits)
    torch.testing.assert_close(_grads(0.1 * out.loss, p["weight"])[0], _grads(0.1 * naive, p["weight"])[0])


def test_neg_inf_teacher_logits_stay_finite():
    p = _linear_problem(seed=12)
    teacher = (p["t_hidden"] @ p["t_weight"].T).detach()
    teacher[:, -2:] = -torch.inf  # e.g. a masked, padded vocabulary
    naive = token_kl(p["hidden"] @ p["weight"].T, teacher)
    out = chunked_token_kl(p["hidden"], OutputHead(p["weight"]), teacher, chunk_size=3)
    assert torch.isfinite(naive) and torch.isfinite(out.forward_kl)
    torch.testing.assert_close(out.loss, naive)
    for got, want in zip(_grads(out.loss, p["hidden"], p["weight"]), _grads(naive, p["hidden"], p["weight"]),
                         strict=True):  # fmt: skip
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def _topk(teacher_logits: Tensor, k: int, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    logprobs = torch.log_softmax(teacher_logits / temperature, -1)
    values, ids = logprobs.topk(k, -1)
    return ids, values


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0), (0.8, 0.2)])
def test_topk_with_full_vocab_equals_full_loss(tail: str, weights: tuple[float, float]):
    student, teacher = _logits(3, 4, seed=13), _logits(3, 4, seed=14).detach()
    mask = torch.rand(3, 4, generator=_gen(15)) > 0.3
    wf, wr = weights
    kwargs = {"forward_weight": wf, "reverse_weight": wr, "temperature": 1.7, "mask": mask}
    full = token_kl(student, teacher, **kwargs)
    ids, logprobs = _topk(teacher, V, temperature=1.7)
    out = topk_token_kl(student, ids, logprobs, tail=tail, **kwargs)
    torch.testing.assert_close(out.loss, full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_grads(out.loss, student)[0], _grads(full, student)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
@pytest.mark.parametrize("k", [4, V])
def test_topk_chunked_matches_topk_on_logits(tail: str, k: int):
    p = _linear_problem(seed=8)
    ids, logprobs = _topk(p["t_hidden"] @ p["t_weight"].T, k)
    kwargs = {"tail": tail, "forward_weight": 0.6, "reverse_weight": 0.4, "temperature": 0.9, "mask": p["mask"]}
    plain = topk_token_kl(p["hidden"] @ p["weight"].T + p["bias"], ids, logprobs, **kwargs)
    chunked = topk_token_kl(p["hidden"], ids, logprobs, head=OutputHead(p["weight"], p["bias"]), chunk_size=3,
                            **kwargs)  # fmt: skip
    for got, want in zip(chunked, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    inputs = (p["hidden"], p["weight"], p["bias"])
    for got, want in zip(_grads(chunked.loss, *inputs), _grads(plain.loss, *inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)


def test_topk_renormalize_matches_distillkit_formula():
    student, teacher = _logits(5, seed=16), _logits(5, seed=17).detach()
    ids, logprobs = _topk(teacher, 3)
    out = topk_token_kl(student, ids, logprobs, forward_weight=0.5, reverse_weight=0.5)
    log_q_k = torch.log_softmax(student, -1).gather(-1, ids)
    log_p_renorm = logprobs - logprobs.logsumexp(-1, keepdim=True)
    fkl = (log_p_renorm.exp() * (log_p_renorm - log_q_k)).sum(-1)
    log_q_renorm = log_q_k - log_q_k.logsumexp(-1, keepdim=True)
    rkl = _manual_kl(log_q_renorm, log_p_renorm)
    torch.testing.assert_close(out.forward_kl, fkl.mean())
    torch.testing.assert_close(out.reverse_kl, rkl.mean())
    torch.testing.assert_close(out.loss, (0.5 * fkl + 0.5 * rkl).mean())


def test_topk_bucket_is_a_coarse_graining_of_the_full_kl():
    student, teacher = _logits(6, seed=18), _logits(6, seed=19).detach()
    ids, logprobs = _topk(teacher, 4)
    out = topk_token_kl(student, ids, logprobs, tail="bucket", forward_weight=1, reverse_weight=1)
    log_q, log_p = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    in_k = torch.zeros(6, V, dtype=torch.bool).scatter(-1, ids, True)
    rest = lambda lp: lp.masked_fill(in_k, -torch.inf).logsumexp(-1, keepdim=True)  # noqa: E731
    coarse_q = torch.cat([log_q.gather(-1, ids), rest(log_q)], -1)
    coarse_p = torch.cat([log_p.gather(-1, ids), rest(log_p)], -1)
    torch.testing.assert_close(out.forward_kl, _manual_kl(coarse_p, coarse_q).mean())
    torch.testing.assert_close(out.reverse_kl, _manual_kl(coarse_q, coarse_p).mean())
    assert out.forward_kl <= _manual_kl(log_p, log_q).mean() and out.reverse_kl <= _manual_kl(log_q, log_p).mean()


def test_all_masked_returns_zero_with_gradient_path():
    p = _linear_problem(seed=9)
    teacher = p["t_hidden"] @ p["t_weight"].T
    none = torch.zeros(10, dtype=torch.bool)
    ids, logprobs = _topk(teacher, 3)
    student = lambda: p["hidden"] @ p["weight"].T  # noqa: E731  (a fresh graph per loss)
    head = OutputHead(p["weight"])
    losses = [
        token_kl(student(), teacher, forward_weight=0.5, reverse_weight=0.5, mask=none),
        chunked_token_kl(p["hidden"], head, teacher, reverse_weight=1, mask=none, chunk_size=3).loss,
        topk_token_kl(student(), ids, logprobs, tail="bucket", reverse_weight=1, mask=none).loss,
        topk_token_kl(p["hidden"], ids, logprobs, head=head, mask=none, chunk_size=3).loss,
        sampled_reverse_kl(student()[:, :2], teacher[:, :2], none[:, None].expand(10, 2)),
    ]
    for loss in losses:
        assert loss.item() == 0 and loss.requires_grad
        for grad in _grads(loss, p["hidden"], p["weight"]):
            assert torch.equal(grad, torch.zeros_like(grad))
    stats = chunked_token_kl(p["hidden"], head, teacher, mask=none)
    assert stats.forward_kl.item() == 0 and stats.num_tokens.item() == 0


def test_float32_inputs_and_bfloat16_chunked_close_to_naive():
    p = _linear_problem(n=16, seed=10)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        hidden = p["hidden"].detach().to(dtype).requires_grad_()
        weight = p["weight"].detach().to(dtype).requires_grad_()
        teacher = p["t_hidden"].to(dtype)
        t_weight = p["t_weight"].to(dtype)
        out = chunked_token_kl(hidden, OutputHead(weight), teacher, teacher_head=OutputHead(t_weight), chunk_size=5)
        naive = token_kl(hidden @ weight.T, teacher @ t_weight.T)
        assert out.loss.dtype == torch.float32
        torch.testing.assert_close(out.loss, naive, rtol=tol, atol=tol)
        for got, want in zip(_grads(out.loss, hidden, weight), _grads(naive, hidden, weight), strict=True):
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_validation_errors():
    student, teacher = _logits(4, seed=20), _logits(4, seed=21)
    p = _linear_problem(n=4, seed=11)
    head = OutputHead(p["weight"])
    ids, logprobs = _topk(teacher.detach(), 3)
    with pytest.raises(ValueError, match="forward_weight and reverse_weight"):
        token_kl(student, teacher, forward_weight=0.0, reverse_weight=0.0)
    with pytest.raises(ValueError, match="forward_weight"):
        chunked_token_kl(p["hidden"], OutputHead(p["weight"]), teacher, forward_weight=-0.1)
    with pytest.raises(ValueError, match="reverse_weight"):
        topk_token_kl(student, ids, logprobs, reverse_weight=-1.0)
    for tau in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            token_kl(student, teacher, temperature=tau)
    with pytest.raises(ValueError, match="teacher_topk_ids.*k=0"):
        topk_token_kl(student, ids[:, :0], logprobs[:, :0])
    wide_ids = torch.arange(V + 1).expand(4, V + 1)
    with pytest.raises(ValueError, match=f"teacher_topk_ids.*vocab size {V}.*k={V + 1}"):
        topk_token_kl(student, wide_ids, torch.zeros(4, V + 1, dtype=DT))
    with pytest.raises(ValueError, match="teacher_topk_ids must be an integer"):
        topk_token_kl(student, ids.double(), logprobs)
    with pytest.raises(ValueError, match="teacher_topk_logprobs shape"):
        topk_token_kl(student, ids, logprobs[:, :2])
    with pytest.raises(ValueError, match="tail"):
        topk_token_kl(student, ids, logprobs, tail="zero")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"student vocab size {V} .*teacher vocab size {V + 1}"):
        token_kl(student, torch.zeros(4, V + 1, dtype=DT))
    with pytest.raises(ValueError, match=f"student vocab size {V} .*teacher vocab size {V - 1}"):
        chunked_token_kl(p["hidden"], OutputHead(p["weight"]), torch.zeros(4, V - 1, dtype=DT))
    with pytest.raises(ValueError, match=f"student vocab size {V} .*teacher vocab size 3"):
        chunked_token_kl(p["hidden"], head, p["t_hidden"], teacher_head=OutputHead(p["t_weight"][:3]))
    with pytest.raises(ValueError, match=r"teacher_head\.weight must be"):
        chunked_token_kl(p["hidden"], head, p["t_hidden"], teacher_head=head)
    with pytest.raises(ValueError, match=r"head\.weight must be"):
        chunked_token_kl(p["hidden"], OutputHead(p["weight"][:, :2]), teacher)
    with pytest.raises(ValueError, match=r"head\.bias"):
        chunked_token_kl(p["hidden"], OutputHead(p["weight"], p["bias"][:3]), teacher)
    with pytest.raises(ValueError, match="teacher shape"):
        chunked_token_kl(p["hidden"], OutputHead(p["weight"]), teacher[:3])
    with pytest.raises(ValueError, match="teacher_logits shape"):
        token_kl(student, teacher[:3])
    with pytest.raises(ValueError, match="mask shape"):
        token_kl(student, teacher, mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask shape"):
        sampled_reverse_kl(student[:, 0:1], teacher[:, 0:1], torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="teacher_logprobs shape"):
        sampled_reverse_kl(student[:, :2], teacher[:, :3])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_kl(p["hidden"], OutputHead(p["weight"]), teacher, chunk_size=0)
    with pytest.raises(ValueError, match="normalizer"):
        chunked_token_kl(p["hidden"], OutputHead(p["weight"]), teacher, normalizer=0)
