import pytest
import torch

from lit_smd.metrics import LogprobMismatch, ResponseLength, TokenEntropy


def test_token_entropy_masked_mean() -> None:
    logits = torch.randn(2, 3, 5)
    entropy = torch.distributions.Categorical(logits=logits).entropy()  # [2, 3]
    mask = torch.tensor([[True, True, False], [True, False, False]])
    metric = TokenEntropy()
    metric.update(entropy, mask)
    expected = entropy[mask].mean()
    torch.testing.assert_close(metric.compute(), expected)
    metric.update(torch.tensor([[1.0, 2.0]]))  # no mask: every token counts
    torch.testing.assert_close(metric.compute(), (entropy[mask].sum() + 3.0) / 5)
    with pytest.raises(ValueError, match="mask shape"):
        metric.update(entropy, mask[:, :2])


def test_uniform_logits_have_log_vocab_entropy() -> None:
    logits = torch.zeros(1, 4, 8)
    metric = TokenEntropy()
    metric.update(-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1))
    torch.testing.assert_close(metric.compute(), torch.log(torch.tensor(8.0)))


def test_response_length() -> None:
    metric = ResponseLength()
    metric.update(torch.tensor([3, 10]), torch.tensor([False, True]))
    metric.update(torch.tensor([5]), torch.tensor([False]))
    result = metric.compute()
    assert {key: value.item() for key, value in result.items()} == {
        "mean_length": 6.0,
        "max_length": 10.0,
        "min_length": 3.0,
        "truncation_rate": pytest.approx(1 / 3),
    }
    with pytest.raises(ValueError, match="2 lengths but 1"):
        metric.update(torch.tensor([1, 2]), torch.tensor([True]))


def test_logprob_mismatch() -> None:
    learner = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    rollout = torch.tensor([[-1.0, -2.5, -3.0], [-0.7, -0.5, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    metric = LogprobMismatch()
    metric.update(learner, rollout, mask)
    diff = (learner - rollout)[mask].double()
    result = metric.compute()
    torch.testing.assert_close(result["abs_diff_mean"], diff.abs().mean().float())
    torch.testing.assert_close(result["abs_diff_max"], torch.tensor(0.5))  # the masked -9 vs 0 is ignored
    torch.testing.assert_close(result["k3_kl"], (diff.exp() - diff - 1).mean().float())
    assert result["k3_kl"] > 0


def test_logprob_mismatch_is_zero_when_equal() -> None:
    logprobs = torch.randn(4, 6).clamp(max=0)
    metric = LogprobMismatch()
    metric.update(logprobs, logprobs.clone())
    assert all(value.item() == 0.0 for value in metric.compute().values())
    with pytest.raises(ValueError, match="differ in shape"):
        metric.update(logprobs, logprobs[:, :3])
