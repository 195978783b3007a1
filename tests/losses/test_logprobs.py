"""`lit_smd.losses.logprobs`: chunked log-probs and the log-probs fused with a token KL, against autograd on
materialised float64 logits."""

import pytest
import torch

from lit_smd.losses.head import LogitTransform, OutputHead
from lit_smd.losses.kl import chunked_token_kl, token_kl
from lit_smd.losses.logprobs import (
    kl_with_policy_grad,
    token_logprobs,
    token_logprobs_and_entropy,
    token_logprobs_and_kl,
)

SOFTCAP = LogitTransform(scale=0.5, softcap=2.0)


def _inputs(seed: int, vocab: int = 11, hidden_size: int = 8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, hidden_size, dtype=dtype, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=dtype, generator=g, requires_grad=True)
    bias = torch.randn(vocab, dtype=dtype, generator=g, requires_grad=True)
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    return hidden, weight, bias, ids


def _logits(hidden, weight, bias, transform):
    z = (hidden @ weight.T + (0 if bias is None else bias)) * transform.scale
    return z if transform.softcap is None else torch.tanh(z / transform.softcap) * transform.softcap


@pytest.mark.parametrize("transform", [LogitTransform(), SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize(("forward_weight", "reverse_weight"), [(1.0, 0.0), (0.0, 1.0), (0.3, 0.7)])
def test_fused_logprobs_and_kl_equal_autograd_on_full_logits(transform, forward_weight, reverse_weight):
    hidden, weight, bias, ids = _inputs(0)
    teacher_hidden = _inputs(1)[0].detach()
    mask = torch.rand(2, 7, generator=torch.Generator().manual_seed(2)) > 0.3
    upstream = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))  # d loss / d logprob
    head = OutputHead(weight, bias, transform)
    logprobs, entropy, kl = token_logprobs_and_kl(
        hidden, head, ids, teacher_hidden, head, forward_weight=forward_weight, reverse_weight=reverse_weight,
        temperature=0.7, mask=mask, chunk_size=3,
    )  # fmt: skip
    student = _logits(hidden, weight, bias, transform)  # [2, 7, V]
    teacher = _logits(teacher_hidden, weight, bias, transform).detach()  # [2, 7, V]
    full = torch.log_softmax(student / 0.7, -1)
    expected_logprobs = full.gather(-1, ids[..., None])[..., 0]
    expected_kl = token_kl(student, teacher, forward_weight=forward_weight, reverse_weight=reverse_weight,
                           temperature=0.7, mask=mask)  # fmt: skip
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-13)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), rtol=0, atol=1e-13)
    torch.testing.assert_close(kl.loss, expected_kl, rtol=1e-12, atol=1e-14)
    assert not entropy.requires_grad and not kl.forward_kl.requires_grad
    # Both terms at once, with an arbitrary per-token upstream gradient (the policy loss's role).
    params = (hidden, weight, bias)
    ours = torch.autograd.grad((logprobs * upstream).sum() + 0.3 * kl.loss, params)
    theirs = torch.autograd.grad((expected_logprobs * upstream).sum() + 0.3 * expected_kl, params)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_fused_equals_the_two_separate_passes():
    hidden, weight, bias, ids = _inputs(4, vocab=23)
    teacher_hidden = _inputs(5, vocab=23)[0].detach()
    head = OutputHead(weight, bias)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    logprobs, entropy, kl = token_logprobs_and_kl(hidden, head, ids, teacher_hidden, head, mask=mask, chunk_size=4)
    separate_logprobs, separate_entropy = token_logprobs_and_entropy(hidden, head, ids, chunk_size=4)
    separate_kl = chunked_token_kl(hidden, head, teacher_hidden, teacher_head=head, mask=mask, chunk_size=4)
    torch.testing.assert_close(logprobs, separate_logprobs, rtol=0, atol=1e-14)
    torch.testing.assert_close(entropy, separate_entropy, rtol=0, atol=1e-14)
    for ours, theirs in zip(kl, separate_kl, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-15)
    ours = torch.autograd.grad(logprobs.sum() - kl.loss, (hidden, weight, bias))
    theirs = torch.autograd.grad(separate_logprobs.sum() - separate_kl.loss, (hidden, weight, bias))
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_logprobs_gradients_reach_only_what_requires_them_and_no_grad_saves_nothing():
    hidden, weight, _, ids = _inputs(6)
    frozen = weight.detach()  # a frozen head (LoRA): only the hidden states get a gradient
    logprobs, _ = token_logprobs_and_entropy(hidden, OutputHead(frozen), ids, chunk_size=5)
    (grad,) = torch.autograd.grad(logprobs.sum(), (hidden,))
    expected = torch.log_softmax(hidden @ frozen.T, -1).gather(-1, ids[..., None]).sum()
    torch.testing.assert_close(grad, torch.autograd.grad(expected, (hidden,))[0], rtol=1e-12, atol=1e-13)
    with torch.no_grad():
        logprobs, _ = token_logprobs_and_entropy(hidden, OutputHead(weight), ids, chunk_size=5)
    assert logprobs.grad_fn is None


def test_fused_logprobs_and_kl_check_their_arguments():
    hidden, weight, _, ids = _inputs(7)
    head = OutputHead(weight)
    with pytest.raises(ValueError, match="teacher_head.weight"):
        token_logprobs_and_kl(hidden, head, ids, hidden.detach(), OutputHead(torch.randn(11, 5, dtype=torch.float64)))
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        token_logprobs_and_kl(hidden, head, ids, hidden.detach(), OutputHead(torch.randn(12, 8, dtype=torch.float64)))
    with pytest.raises(ValueError, match="teacher_hidden must have shape"):
        token_logprobs_and_kl(hidden, head, ids, hidden[:, :3].detach(), head)
    with pytest.raises(ValueError, match="reverse_weight"):
        token_logprobs_and_kl(hidden, head, ids, hidden.detach(), head, forward_weight=0.0)
    with pytest.raises(ValueError, match="mask shape"):
        token_logprobs_and_kl(hidden, head, ids, hidden.detach(), head, mask=torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.parametrize("transform", [LogitTransform(), SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize(("forward_weight", "reverse_weight"), [(1.0, 0.0), (0.0, 1.0), (0.3, 0.7)])
def test_kl_with_policy_grad_carries_both_gradients(transform, forward_weight, reverse_weight):
    """``L.detach() + loss`` against autograd of ``L(logprobs) + kl_coef * KL`` on materialised float64 logits, for a
    policy term ``L`` that is not linear in the log-probs (its gradient is taken first, as the learner does)."""
    hidden, weight, bias, ids = _inputs(8)
    teacher_hidden = _inputs(9)[0].detach()
    mask = torch.rand(2, 7, generator=torch.Generator().manual_seed(10)) > 0.3
    advantages = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    head = OutputHead(weight, bias, transform)

    def policy_term(logprobs):  # clipped-ratio-like, zero outside the mask
        return -(torch.exp(logprobs - 0.1).clamp(max=0.9) * advantages * mask).sum() / mask.sum()

    with torch.no_grad():
        logprobs, _ = token_logprobs_and_entropy(hidden, head, ids, temperature=0.7, chunk_size=3)
    logprobs.requires_grad_()
    policy_value = policy_term(logprobs)
    (logprob_grad,) = torch.autograd.grad(policy_value, logprobs)
    loss, kl = kl_with_policy_grad(
        hidden, head, ids, logprob_grad, teacher_hidden, head, kl_coef=0.3, forward_weight=forward_weight,
        reverse_weight=reverse_weight, temperature=0.7, mask=mask, chunk_size=3,
    )  # fmt: skip
    total = policy_value.detach() + loss

    student = _logits(hidden, weight, bias, transform)  # [2, 7, V]
    teacher = _logits(teacher_hidden, weight, bias, transform).detach()  # [2, 7, V]
    full_logprobs = torch.log_softmax(student / 0.7, -1).gather(-1, ids[..., None])[..., 0]  # [2, 7]
    expected_kl = token_kl(student, teacher, forward_weight=forward_weight, reverse_weight=reverse_weight,
                           temperature=0.7, mask=mask)  # fmt: skip
    expected = policy_term(full_logprobs) + 0.3 * expected_kl
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kl.loss, expected_kl.detach(), rtol=1e-12, atol=1e-14)
    assert not kl.loss.requires_grad
    params = (hidden, weight, bias)
    for got, want in zip(torch.autograd.grad(total, params), torch.autograd.grad(expected, params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_kl_with_policy_grad_checks_its_arguments():
    hidden, weight, _, ids = _inputs(12)
    head, grad = OutputHead(weight), torch.zeros(2, 7, dtype=torch.float64)
    with pytest.raises(ValueError, match="logprob_grad must have ids' shape"):
        kl_with_policy_grad(hidden, head, ids, grad[:, :3], hidden.detach(), head, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        kl_with_policy_grad(hidden, head, ids, grad, hidden.detach(), head, kl_coef=-0.1)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        kl_with_policy_grad(hidden, head, ids, grad, hidden.detach(), OutputHead(torch.randn(12, 8)), kl_coef=0.1)
    with pytest.raises(ValueError, match="mask shape"):
        kl_with_policy_grad(hidden, head, ids, grad, hidden.detach(), head, kl_coef=0.1, mask=torch.ones(2, 6) > 0)


@pytest.mark.parametrize("transform", [LogitTransform(), SOFTCAP], ids=["plain", "softcap"])
def test_token_logprobs_are_those_of_token_logprobs_and_entropy_bit_for_bit(transform):
    """Values and gradients equal to `token_logprobs_and_entropy`'s (the same ops per chunk, the entropy left out),
    which the tests above hold against materialised float64 logits."""
    hidden, weight, bias, ids = _inputs(12)
    head = OutputHead(weight, bias, transform)
    upstream = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    alone = token_logprobs(hidden, head, ids, temperature=0.7, chunk_size=3)
    beside, _ = token_logprobs_and_entropy(hidden, head, ids, temperature=0.7, chunk_size=3)
    assert torch.equal(alone, beside)
    params = (hidden, weight, bias)
    for got, want in zip(torch.autograd.grad((alone * upstream).sum(), params),
                         torch.autograd.grad((beside * upstream).sum(), params), strict=True):  # fmt: skip
        assert torch.equal(got, want)


@pytest.mark.parametrize("transform", [LogitTransform(), SOFTCAP], ids=["plain", "softcap"])
def test_a_mask_projects_only_its_positions_with_the_values_and_gradients_of_all(monkeypatch, transform):
    """With ``mask`` only its positions reach the chunked pass; there the log-probs, entropies and gradients are those
    of scoring every position (float64, 1e-12), elsewhere 0 with no gradient; `token_logprobs` with the same mask
    gives `token_logprobs_and_entropy`'s log-probs bit for bit. A mask of every position, or none, scores as None
    does, zeroed outside it."""
    import lit_smd.losses.logprobs as logprobs_module

    projected, chunked = [], logprobs_module._apply
    monkeypatch.setattr(logprobs_module, "_apply", lambda hidden, *args, **kwargs: projected.append(
        hidden.shape[:-1]) or chunked(hidden, *args, **kwargs))  # fmt: skip
    hidden, weight, bias, ids = _inputs(14)
    head = OutputHead(weight, bias, transform)
    mask = torch.arange(7)[None, :] < torch.tensor([[5], [2]])  # completions that stopped early
    upstream = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(15))
    params = (hidden, weight, bias)
    logprobs, entropy = token_logprobs_and_entropy(hidden, head, ids, temperature=0.7, chunk_size=3, mask=mask)
    alone = token_logprobs(hidden, head, ids, temperature=0.7, chunk_size=3, mask=mask)
    assert projected == [(7,), (7,)]  # 5 + 2 positions
    every, every_entropy = token_logprobs_and_entropy(hidden, head, ids, temperature=0.7, chunk_size=3)
    assert (logprobs - every * mask).abs().max() <= 1e-12 and (entropy - every_entropy * mask).abs().max() <= 1e-12
    assert not logprobs[~mask].any() and not entropy[~mask].any() and torch.equal(alone, logprobs)
    grads = torch.autograd.grad((logprobs * upstream).sum(), params)
    for got, want in zip(grads, torch.autograd.grad((every * upstream * mask).sum(), params), strict=True):
        assert (got - want).abs().max() <= 1e-12
    for got, want in zip(grads, torch.autograd.grad((alone * upstream).sum(), params), strict=True):
        assert torch.equal(got, want)
    for whole in (torch.ones_like(mask), torch.zeros_like(mask)):
        got, got_entropy = token_logprobs_and_entropy(hidden, head, ids, temperature=0.7, chunk_size=3, mask=whole)
        assert torch.equal(got, every * whole) and torch.equal(got_entropy, every_entropy * whole)
    flat = token_logprobs(hidden.flatten(0, 1), head, ids.flatten(), temperature=0.7, chunk_size=3,
                          mask=mask.flatten())  # [B*N, H] with [B*N] ids: any leading shape, as without a mask
    assert torch.equal(flat, alone.flatten())


def test_kl_with_policy_grad_writes_the_student_entropy_per_token():
    hidden, weight, bias, ids = _inputs(14)
    head = OutputHead(weight, bias)
    teacher_hidden = _inputs(15)[0].detach()
    _, expected = token_logprobs_and_entropy(hidden, head, ids, temperature=0.7, chunk_size=3)
    entropy = torch.full((2, 7), float("nan"), dtype=torch.float64)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False  # the entropy of every token, not only the KL's
    kl_with_policy_grad(hidden, head, ids, torch.zeros(2, 7), teacher_hidden, head, kl_coef=0.3, temperature=0.7,
                        mask=mask, chunk_size=3, entropy_out=entropy)  # fmt: skip
    assert torch.equal(entropy, expected)
    with pytest.raises(ValueError, match=r"entropy_out must have ids' shape \(2, 7\), got \(14,\)"):
        kl_with_policy_grad(hidden, head, ids, torch.zeros(2, 7), teacher_hidden, head, kl_coef=0.3,
                            entropy_out=entropy.view(-1))  # fmt: skip
