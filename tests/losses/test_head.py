"""`lit_smd.losses.head`: the family's logit post-processing, against transformers' forward and autograd."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_smd.losses.head import (
    CPU_CHUNK_BYTES,
    LogitTransform,
    OutputHead,
    at_rows,
    head_rows,
    logits_chunk_rows,
    output_head,
    rows_of,
)
from lit_smd.losses.kl import chunked_token_kl, token_kl
from lit_smd.losses.kl_topk import topk_token_kl
from lit_smd.losses.logprobs import token_logprobs_and_entropy

TINY = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64}  # fmt: skip


def tiny(model_type: str, **overrides) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **TINY, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").double().eval()


@pytest.mark.parametrize(
    ("model_type", "overrides", "transform"),
    [
        ("llama", {}, LogitTransform()),
        ("granite", {"logits_scaling": 4.0}, LogitTransform(scale=0.25)),
        ("cohere", {"logit_scale": 0.5}, LogitTransform(scale=0.5)),
        ("gemma2", {"final_logit_softcapping": 0.7}, LogitTransform(softcap=0.7)),
        ("gemma3_text", {"final_logit_softcapping": 0.7}, LogitTransform(softcap=0.7)),
    ],
)
def test_output_head_computes_the_logits_of_the_models_forward(model_type, overrides, transform):
    model = tiny(model_type, **overrides)
    head = output_head(model)
    assert head.transform == transform
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state  # [2, 7, H]
        expected = model(input_ids=ids).logits  # transformers' own post-processing
    torch.testing.assert_close(head(hidden), expected, rtol=0, atol=1e-13)


def test_unknown_logit_attributes_are_refused_by_model_type_and_name():
    model = tiny("llama")
    model.config.logits_scaling = 2.0  # a Llama-type model whose (remote) forward would divide its logits
    with pytest.raises(NotImplementedError, match=r"'llama'.*logits_scaling=2\.0"):
        output_head(model)


def test_logit_transform_checks_its_fields():
    with pytest.raises(ValueError, match="scale"):
        LogitTransform(scale=0.0)
    with pytest.raises(ValueError, match="softcap"):
        LogitTransform(softcap=-1.0)


TRANSFORM = LogitTransform(scale=0.5, softcap=2.0)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    return hidden, weight, bias


def _reference_logits(hidden, weight, bias):
    return torch.tanh((hidden @ weight.T + bias) * 0.5 / 2.0) * 2.0


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def test_token_logprobs_apply_the_transform_with_its_gradient():
    hidden, weight, bias = _inputs()
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    head = OutputHead(weight, bias, TRANSFORM)
    logprobs, _ = token_logprobs_and_entropy(hidden, head, ids, temperature=0.7, chunk_size=3)
    reference = torch.log_softmax(_reference_logits(hidden, weight, bias) / 0.7, -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(logprobs, reference, rtol=0, atol=1e-13)
    for ours, theirs in zip(_grads(logprobs.sum(), (hidden, weight, bias)),
                            _grads(reference.sum(), (hidden, weight, bias)), strict=True):  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("forward_weight", "reverse_weight"), [(1.0, 0.0), (0.3, 0.7)])
def test_chunked_token_kl_applies_both_transforms_with_their_gradients(forward_weight, reverse_weight):
    hidden, weight, bias = _inputs()
    teacher_hidden, teacher_weight, _ = _inputs(seed=2)
    teacher_transform = LogitTransform(scale=2.0)
    out = chunked_token_kl(
        hidden, OutputHead(weight, bias, TRANSFORM), teacher_hidden,
        teacher_head=OutputHead(teacher_weight, transform=teacher_transform), forward_weight=forward_weight,
        reverse_weight=reverse_weight, temperature=0.7, chunk_size=3,
    )  # fmt: skip
    reference = token_kl(
        _reference_logits(hidden, weight, bias), (teacher_hidden @ teacher_weight.T) * 2.0,
        forward_weight=forward_weight, reverse_weight=reverse_weight, temperature=0.7,
    )  # fmt: skip
    torch.testing.assert_close(out.loss, reference, rtol=1e-12, atol=1e-14)
    for ours, theirs in zip(_grads(out.loss, (hidden, weight, bias)),
                            _grads(reference, (hidden, weight, bias)), strict=True):  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


def test_topk_token_kl_applies_the_transform_with_its_gradient():
    hidden, weight, bias = _inputs()
    g = torch.Generator().manual_seed(3)
    teacher = torch.log_softmax(torch.randn(2, 5, 11, dtype=torch.float64, generator=g), -1).topk(4, dim=-1)
    out = topk_token_kl(
        hidden, teacher.indices, teacher.values, head=OutputHead(weight, bias, TRANSFORM), tail="bucket",
        reverse_weight=0.5, chunk_size=3,
    )  # fmt: skip
    reference = topk_token_kl(
        _reference_logits(hidden, weight, bias), teacher.indices, teacher.values, tail="bucket", reverse_weight=0.5
    )
    torch.testing.assert_close(out.loss, reference.loss, rtol=1e-12, atol=1e-14)
    for ours, theirs in zip(_grads(out.loss, (hidden, weight, bias)),
                            _grads(reference.loss, (hidden, weight, bias)), strict=True):  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


def test_chunked_argmax_matches_the_full_projection():
    hidden, weight, bias = _inputs()  # [2, 5, H]
    head = OutputHead(weight, bias, TRANSFORM)
    full = _reference_logits(hidden, weight, bias).argmax(-1)  # [2, 5]
    for chunk_size in (1, 3, 10, 64):
        assert torch.equal(head.argmax(hidden, chunk_size), full)
    assert head.argmax(hidden[:, :0], 3).shape == (2, 0)  # no rows: an empty result, not an error


@pytest.mark.parametrize(
    ("vocab", "rows"),
    [(256, 1024), (8192, 1024), (8193, 512), (32000, 256), (49152, 128), (151936, 32), (CPU_CHUNK_BYTES // 4 + 1, 1)],
)
def test_default_cpu_logits_chunk_is_the_most_rows_whose_float32_buffer_fits(vocab, rows):
    assert logits_chunk_rows(None, vocab, "cpu") == rows
    assert rows == 1024 or 2 * rows * vocab * 4 > CPU_CHUNK_BYTES  # twice as many would not fit
    assert rows == 1 or rows * vocab * 4 <= CPU_CHUNK_BYTES


def test_logits_chunk_rows_off_the_cpu_and_when_given():
    assert logits_chunk_rows(None, 151936, "cuda") == 1024  # a GPU's caching allocator reuses the buffers
    assert logits_chunk_rows(7, 151936, "cpu") == logits_chunk_rows(7, 256, torch.device("cuda")) == 7
    assert logits_chunk_rows(None, 49152, "cpu", torch.float64) == 64  # float64 logits: 8 B each
    assert logits_chunk_rows(None, 49152, "cpu", torch.bfloat16) == 128  # float32 logits
    head = OutputHead(torch.zeros(49152, 4))
    assert head.chunk_rows(None) == 128 and head.chunk_rows(3) == 3
    assert OutputHead(torch.zeros(49152, 4, dtype=torch.float64)).chunk_rows(None) == 64  # float64 logits: 8 B each
    assert OutputHead(torch.zeros(49152, 4, dtype=torch.bfloat16)).chunk_rows(None) == 128  # float32 logits


def test_head_rows_select_the_masked_positions_and_lay_them_out_again():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    rows = head_rows(mask)
    assert torch.equal(rows, torch.tensor([0, 1, 3]))  # flat positions, row-major
    hidden = torch.arange(12.0).view(2, 3, 2).requires_grad_()
    taken = rows_of(hidden, rows)  # [1, 3, 2]: positions (0, 0), (0, 1), (1, 0)
    assert torch.equal(taken, torch.tensor([[[0.0, 1.0], [2.0, 3.0], [6.0, 7.0]]]))
    laid_out = at_rows(taken.sum(-1), rows, mask.shape)
    assert torch.equal(laid_out, torch.tensor([[1.0, 5.0, 0.0], [13.0, 0.0, 0.0]]))
    laid_out.sum().backward()
    assert torch.equal(hidden.grad, mask[..., None].expand(-1, -1, 2).float())  # the padding gets no gradient
    for every in (torch.ones_like(mask), torch.zeros_like(mask)):  # all (or none: a chunked pass needs a row)
        assert head_rows(every) is None
        view = rows_of(hidden, None)
        assert view.shape == (1, 6, 2) and view.data_ptr() == hidden.data_ptr()  # a view, nothing copied
        assert at_rows(view.sum(-1), None, mask.shape).shape == mask.shape
