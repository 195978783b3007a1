"""Bad input to the plain-PyTorch layer: every compressor of `lit_smd.kv.COMPRESSORS`, `lit_smd.rollout.generate`
and the loss functions of `lit_smd.losses`. All of it is rejected before any model forward or tensor math."""

import dataclasses
import math

import pytest
import torch

from lit_smd.kv import COMPRESSORS, H2O, PrefillThenDecode, RandomEviction, RecentWindow, SnapKV
from lit_smd.losses import (
    SparseRLConfig,
    chunked_token_kl,
    group_advantages,
    mismatch_stats,
    policy_loss,
    sampled_reverse_kl,
    token_kl,
    token_logprobs,
    token_logprobs_and_entropy,
    topk_token_kl,
)
from lit_smd.losses.head import OutputHead
from lit_smd.rollout import generate

NAN, INF = math.nan, math.inf


def make_compressor(name: str, **fields: object):
    """Registry entry ``name`` with small windows, ``fields`` overriding them (a new entry must be added here)."""
    defaults = {
        "snapkv": (SnapKV, {"budget": 16, "window": 4}),
        "h2o": (H2O, {"budget": 16, "window": 4, "sinks": 1}),
        "recent": (RecentWindow, {"budget": 16, "sinks": 4}),
        "random": (RandomEviction, {"budget": 16, "window": 4, "sinks": 2}),
    }
    cls, kwargs = defaults[name]
    return cls(**{**kwargs, **fields})


SINGLE_POLICIES = sorted(set(COMPRESSORS) - {"prefill_then_decode"})

# (field, bad value, regex with {cls} for the class name): tried on every registry entry that has the field.
COMPRESSOR_FIELD_ERRORS = [
    ("budget", 0, r"{cls}\.budget=0 is smaller than the keys the compressor always keeps; it must be >= \d+ "
     r"\(window \+ sinks\), or a fraction of the context, a float in \(0, 1\] such as 0\.5$"),
    ("budget", -1, r"{cls}\.budget=-1 is smaller than the keys the compressor always keeps"),
    ("budget", 3, r"{cls}\.budget=3 is smaller .*; it must be >= \d+ \(window \+ sinks\)"),
    ("budget", 0.0, r"{cls}\.budget as a fraction must be in \(0, 1\], got 0\.0"),
    ("budget", 1.5, r"{cls}\.budget as a fraction must be in \(0, 1\], got 1\.5; or give an absolute budget, an "
     r"int token count >= \d+ \(window \+ sinks\)$"),
    ("budget", NAN, r"{cls}\.budget as a fraction must be in \(0, 1\], got nan"),
    ("budget", "half", r"{cls}\.budget must be an int token count or a float fraction, got 'half'"),
    ("budget", True, r"{cls}\.budget must be an int token count or a float fraction, got True"),
    ("window", -1, r"{cls}\.window must be an integer >= 0, got -1"),
    ("window", 2.5, r"{cls}\.window must be an integer >= 0, got 2\.5"),
    ("sinks", -1, r"{cls}\.sinks must be an integer >= 0, got -1"),
]


def _fields(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(type(make_compressor(name)))}


@pytest.mark.parametrize(
    ("name", "field", "value", "pattern"),
    [(name, *case) for name in SINGLE_POLICIES for case in COMPRESSOR_FIELD_ERRORS if case[0] in _fields(name)],
    ids=lambda v: repr(v),
)
def test_compressor_rejects(name, field, value, pattern):
    cls = type(make_compressor(name))
    with pytest.raises(ValueError, match=pattern.format(cls=cls.__name__)):
        make_compressor(name, **{field: value})


def test_every_registry_entry_is_covered():
    assert set(COMPRESSORS) == {*SINGLE_POLICIES, "prefill_then_decode"}
    for name in SINGLE_POLICIES:
        make_compressor(name)  # the defaults themselves are valid


# (case, constructor, regex): what only some compressors have, and the composition.
COMPOSITE_ERRORS = [
    ("SnapKV window 0", lambda: SnapKV(16, window=0), r"SnapKV\.window must be >= 1, got 0"),
    ("SnapKV even kernel", lambda: SnapKV(16, window=4, kernel=2), r"SnapKV\.kernel must be an odd integer >= 1"),
    ("SnapKV pooling", lambda: SnapKV(16, window=4, pooling="min"), r"SnapKV\.pooling must be 'avg' or 'max'"),
    ("unequal budgets", lambda: PrefillThenDecode(SnapKV(0.5, window=4), H2O(0.4, window=4)),
     r"PrefillThenDecode\.prefill\.budget and PrefillThenDecode\.decode\.budget must be equal, got 0\.5 and 0\.4"),
    ("int and fraction budgets", lambda: PrefillThenDecode(SnapKV(16, window=4), H2O(0.5, window=4)),
     r"budget must be equal, got 16 and 0\.5"),
    ("decode policy that never evicts", lambda: PrefillThenDecode(SnapKV(16, window=4), SnapKV(16, window=4)),
     r"PrefillThenDecode\.decode must evict during decoding \(H2O, RecentWindow, RandomEviction\), got SnapKV"),
    ("prefill by name", lambda: PrefillThenDecode("snapkv", H2O(16, window=4)),
     r"PrefillThenDecode\.prefill must be a compressor \(e\.g\. SnapKV, H2O\), got 'snapkv'"),
    ("decode missing", lambda: PrefillThenDecode(SnapKV(16, window=4), None),
     r"PrefillThenDecode\.decode must be a compressor \(e\.g\. SnapKV, H2O\), got None"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "pattern"), [c[1:] for c in COMPOSITE_ERRORS], ids=[c[0] for c in COMPOSITE_ERRORS])
def test_compressor_specifics_rejected(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def prompts(*lengths: int, vocab: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of the given lengths: ``(input_ids, attention_mask)``."""
    width = max(lengths)
    ids = torch.randint(6, vocab, (len(lengths), width))
    mask = torch.stack([torch.arange(width) >= width - n for n in lengths]).long()
    return ids * mask, mask


IDS, MASK = prompts(6, 4)

# (case, arguments of generate besides the model, regex); max_new_tokens=2 unless given.
GENERATE_ERRORS = [
    ("zero max_new_tokens", {"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1, got 0"),
    ("float max_new_tokens", {"max_new_tokens": 2.0}, r"max_new_tokens must be an integer >= 1, got 2\.0"),
    ("zero temperature", {"temperature": 0.0}, r"temperature must be > 0 and finite, got 0\.0"),
    ("NaN temperature", {"temperature": NAN}, r"temperature must be > 0 and finite, got nan"),
    ("infinite temperature", {"temperature": INF}, r"temperature must be > 0 and finite, got inf"),
    ("zero top_p", {"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
    ("negative top_k", {"top_k": -1}, r"top_k must be >= 0 \(0 disables it\), got -1"),
    ("zero num_generations", {"num_generations": 0}, r"num_generations must be >= 1, got 0"),
    ("empty batch", {"input_ids": IDS[:0], "attention_mask": MASK[:0]},
     r"input_ids is empty \(shape \(0, 6\)\): nothing to generate from"),
    ("ids as a list", {"input_ids": IDS.tolist()},
     r"input_ids must be a 2-D tensor \[batch, prompt_length\], got list"),
    ("float ids", {"input_ids": IDS.float()}, r"input_ids must hold integer token ids, got dtype torch\.float32"),
    ("mask of another shape", {"attention_mask": MASK[:, 1:]},
     r"attention_mask must have the shape of input_ids \(2, 6\), got \(2, 5\)"),
    ("right-padded prompts", {"attention_mask": MASK.flip(1)}, r"prompts must be left-padded"),
    ("prompt without tokens", {"attention_mask": MASK * torch.tensor([[1], [0]])},
     r"attention_mask has a row with no real token"),
    ("ids beyond the vocabulary", {"input_ids": IDS + 200},
     r"input_ids hold token ids in \[\d+, \d+\] but the model embeds only ids \[0, 103\): the tokenizer does not"),
    ("compressor by name", {"compressor": "snapkv"},
     r"compressor must be one of lit_smd\.kv\.COMPRESSORS or None, got 'snapkv'"),
    ("prompt shorter than the SnapKV window", {"compressor": SnapKV(16, window=5)},
     r"a prompt of 4 tokens is shorter than the SnapKV observation window \(5\)"),
    ("fraction budget below the windows", {"compressor": H2O(0.1, window=4, budget_mode="fixed")},
     r"H2O\.budget=0\.1 resolves to 0 keys for a prompt of 4 tokens with max_new_tokens=2, below the minimum of 4"),
    ("paper-mode budget below the windows", {"compressor": H2O(0.5, window=4)},
     r"H2O\.budget=0\.5 \(budget_mode='paper'\) keeps 2 keys of a prompt of 4 tokens, below the minimum of 4 "
     r"\(window \+ sinks\); prompts need at least 8 tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "pattern"), [c[1:] for c in GENERATE_ERRORS], ids=[c[0] for c in GENERATE_ERRORS])
def test_generate_rejects_before_any_forward(kwargs, pattern, tiny_policy):
    calls = []
    hook = tiny_policy.register_forward_pre_hook(lambda *args: calls.append(1))
    args = {"input_ids": IDS, "attention_mask": MASK, "max_new_tokens": 2, **kwargs}
    try:
        with pytest.raises(ValueError, match=pattern):
            generate(tiny_policy, args.pop("input_ids"), args.pop("attention_mask"), **args)
    finally:
        hook.remove()
    assert calls == []


B, N, V, H = 2, 3, 7, 4
LOGITS = torch.randn(B, N, V)
HIDDEN, WEIGHT = torch.randn(B, N, H), torch.randn(V, H)
HEAD = OutputHead(WEIGHT)
TOKEN_IDS = torch.randint(0, V, (B, N))
TOPK_IDS, TOPK_LOGPROBS = torch.randint(0, V, (B, N, 3)), torch.randn(B, N, 3)
LOGPROBS, MASK_BN = torch.randn(B, N), torch.ones(B, N, dtype=torch.bool)
ADVANTAGES = torch.randn(B)

# (case, call, regex): each loss function's own checks.
LOSS_ERRORS = [
    ("token_kl: shapes", lambda: token_kl(LOGITS, LOGITS[:, :2]),
     r"teacher_logits shape \(2, 2, 7\) != student_logits shape \(2, 3, 7\)"),
    ("token_kl: vocabularies", lambda: token_kl(LOGITS, LOGITS[..., :5]),
     r"vocabulary mismatch: student vocab size 7 \(student_logits\) != teacher vocab size 5"),
    ("token_kl: both weights zero", lambda: token_kl(LOGITS, LOGITS, forward_weight=0.0),
     r"forward_weight and reverse_weight are both 0"),
    ("token_kl: negative weight", lambda: token_kl(LOGITS, LOGITS, reverse_weight=-0.2),
     r"reverse_weight must be >= 0 and finite, got -0\.2"),
    ("token_kl: NaN weight", lambda: token_kl(LOGITS, LOGITS, forward_weight=NAN),
     r"forward_weight must be >= 0 and finite, got nan"),
    ("token_kl: infinite weight", lambda: token_kl(LOGITS, LOGITS, forward_weight=INF),
     r"forward_weight must be >= 0 and finite, got inf"),
    ("token_kl: zero temperature", lambda: token_kl(LOGITS, LOGITS, temperature=0.0),
     r"temperature must be > 0 and finite, got 0\.0"),
    ("token_kl: mask shape", lambda: token_kl(LOGITS, LOGITS, mask=torch.ones(B, N + 1, dtype=torch.bool)),
     r"mask shape \(2, 4\) != token shape \(2, 3\)"),
    ("token_kl: 1-D logits", lambda: token_kl(LOGITS[0, 0], LOGITS[0, 0]),
     r"student_logits must be \[N, V\] or \[B, T, V\], got shape \(7,\)"),
    ("chunked_token_kl: zero chunk", lambda: chunked_token_kl(HIDDEN, HEAD, LOGITS, chunk_size=0),
     r"chunk_size must be >= 1, got 0"),
    ("chunked_token_kl: lm_head shape", lambda: chunked_token_kl(HIDDEN, OutputHead(torch.randn(V, H + 1)), LOGITS),
     r"head.weight must be \[V, H\] with H = student_hidden.shape\[-1\] = 4, got shape \(7, 5\)"),
    ("chunked_token_kl: teacher vocabulary",
     lambda: chunked_token_kl(HIDDEN, HEAD, HIDDEN, teacher_head=OutputHead(torch.randn(V + 1, H))),
     r"vocabulary mismatch: student vocab size 7 \(head.weight.shape\[0\]\) != teacher vocab size 8"),
    ("chunked_token_kl: zero normalizer", lambda: chunked_token_kl(HIDDEN, HEAD, LOGITS, normalizer=0),
     r"normalizer must be > 0, got 0"),
    ("topk_token_kl: k = 0", lambda: topk_token_kl(LOGITS, TOPK_IDS[..., :0], TOPK_LOGPROBS[..., :0]),
     r"teacher_topk_ids: k must be in \[1, vocab size 7\], got k=0"),
    ("topk_token_kl: k > V", lambda: topk_token_kl(LOGITS, torch.zeros(B, N, 9, dtype=torch.long),
                                                   torch.zeros(B, N, 9)),
     r"teacher_topk_ids: k must be in \[1, vocab size 7\], got k=9"),
    ("topk_token_kl: float ids", lambda: topk_token_kl(LOGITS, TOPK_IDS.float(), TOPK_LOGPROBS),
     r"teacher_topk_ids must be an integer tensor, got torch.float32"),
    ("topk_token_kl: ids vs log-probs", lambda: topk_token_kl(LOGITS, TOPK_IDS, TOPK_LOGPROBS[..., :2]),
     r"teacher_topk_ids shape \(2, 3, 3\) != teacher_topk_logprobs shape \(2, 3, 2\)"),
    ("topk_token_kl: token dimensions", lambda: topk_token_kl(LOGITS[:, :2], TOPK_IDS, TOPK_LOGPROBS),
     r"teacher_topk_ids shape \(2, 3, 3\) does not match student shape \(2, 2, 7\) in the token dimensions"),
    ("topk_token_kl: tail", lambda: topk_token_kl(LOGITS, TOPK_IDS, TOPK_LOGPROBS, tail="drop"),
     r"tail must be 'renormalize' or 'bucket', got 'drop'"),
    ("sampled_reverse_kl: shapes", lambda: sampled_reverse_kl(LOGPROBS, LOGPROBS[:, :2]),
     r"student_logprobs shape \(2, 3\) != teacher_logprobs shape \(2, 2\)"),
    ("sampled_reverse_kl: zero weight", lambda: sampled_reverse_kl(LOGPROBS, LOGPROBS, reverse_weight=0.0),
     r"reverse_weight must be finite and > 0 for the sampled reverse-KL estimator, got 0.0"),
    ("sampled_reverse_kl: infinite weight", lambda: sampled_reverse_kl(LOGPROBS, LOGPROBS, reverse_weight=math.inf),
     r"reverse_weight must be finite and > 0 for the sampled reverse-KL estimator, got inf"),
    ("policy_loss: advantages", lambda: policy_loss(LOGPROBS, LOGPROBS, ADVANTAGES[:1], MASK_BN),
     r"`advantages` must have shape \[B\] = \(2,\), got \(1,\)"),
    ("policy_loss: float mask", lambda: policy_loss(LOGPROBS, LOGPROBS, ADVANTAGES, MASK_BN.float()),
     r"`mask` must be a bool tensor \(True = loss token\), got dtype torch.float32"),
    ("policy_loss: log-prob shape", lambda: policy_loss(LOGPROBS[:, :2], LOGPROBS, ADVANTAGES, MASK_BN),
     r"`logprobs` must have the shape of `mask` \(2, 3\), got \(2, 2\)"),
    ("policy_loss: epsilon", lambda: policy_loss(LOGPROBS, LOGPROBS, ADVANTAGES, MASK_BN, epsilon=-0.1),
     r"`epsilon` must be in \[0, 1\], got -0\.1"),
    ("policy_loss: beta without reference", lambda: policy_loss(LOGPROBS, LOGPROBS, ADVANTAGES, MASK_BN, beta=0.1),
     r"`ref_logprobs` is required when `beta` > 0"),
    ("policy_loss: loss_type", lambda: policy_loss(LOGPROBS, LOGPROBS, ADVANTAGES, MASK_BN, loss_type="ppo"),
     r"`loss_type` must be one of \('grpo', 'dr_grpo', 'dapo'\), got 'ppo'"),
    ("policy_loss: dr_grpo length", lambda: policy_loss(LOGPROBS, LOGPROBS, ADVANTAGES, MASK_BN, loss_type="dr_grpo",
                                                        max_completion_length=2),
     r"`max_completion_length` must be >= N = 3 and >= 1, got 2"),
    ("mismatch_stats: shapes", lambda: mismatch_stats(LOGPROBS[:1], LOGPROBS, MASK_BN),
     r"`learner_logprobs` must have the shape of `mask` \(2, 3\), got \(1, 3\)"),
    ("group_advantages: NaN reward", lambda: group_advantages(torch.tensor([1.0, NAN, 0.0, 1.0]), 2),
     r"`rewards` must be finite; rows \[1\] are not"),
    ("group_advantages: group size", lambda: group_advantages(torch.ones(4), 3),
     r"`rewards` has 4 rows, not a multiple of `num_generations` 3"),
    ("group_advantages: scale_rewards", lambda: group_advantages(torch.ones(4), 2, "std"),
     r"`scale_rewards` must be one of \('group', 'batch', 'none'\), got 'std'"),
    ("group_advantages: 2-D rewards", lambda: group_advantages(torch.ones(2, 2), 2),
     r"`rewards` must have shape \[B\], got \(2, 2\)"),
    ("token_logprobs: ids shape", lambda: token_logprobs_and_entropy(HIDDEN, OutputHead(WEIGHT), TOKEN_IDS[:, :2]),
     r"hidden must have shape \[\*ids.shape, H\]: got hidden \(2, 3, 4\) and ids \(2, 2\)"),
    ("token_logprobs: weight shape", lambda: token_logprobs_and_entropy(HIDDEN, OutputHead(WEIGHT.T), TOKEN_IDS),
     r"head.weight must be \[V, H\] with H = hidden.shape\[-1\] = 4, got shape \(4, 7\)"),
    ("token_logprobs: bias shape",
     lambda: token_logprobs_and_entropy(HIDDEN, OutputHead(WEIGHT, torch.zeros(V + 1)), TOKEN_IDS),
     r"head.bias must have shape \(7,\), got \(8,\)"),
    ("token_logprobs: zero temperature",
     lambda: token_logprobs_and_entropy(HIDDEN, OutputHead(WEIGHT), TOKEN_IDS, temperature=0.0),
     r"temperature must be > 0 and finite, got 0\.0"),
    ("token_logprobs: infinite temperature",
     lambda: token_logprobs_and_entropy(HIDDEN, OutputHead(WEIGHT), TOKEN_IDS, temperature=float("inf")),
     r"temperature must be > 0 and finite, got inf"),
    ("token_logprobs: zero chunk",
     lambda: token_logprobs_and_entropy(HIDDEN, OutputHead(WEIGHT), TOKEN_IDS, chunk_size=0),
     r"chunk_size must be an integer >= 1, got 0"),
    ("token_logprobs (alone): ids shape", lambda: token_logprobs(HIDDEN, OutputHead(WEIGHT), TOKEN_IDS[:, :2]),
     r"hidden must have shape \[\*ids.shape, H\]: got hidden \(2, 3, 4\) and ids \(2, 2\)"),
    ("token_logprobs (alone): zero chunk", lambda: token_logprobs(HIDDEN, OutputHead(WEIGHT), TOKEN_IDS, chunk_size=0),
     r"chunk_size must be an integer >= 1, got 0"),
    ("token_logprobs: float mask",
     lambda: token_logprobs_and_entropy(HIDDEN, OutputHead(WEIGHT), TOKEN_IDS, mask=torch.ones(2, 3)),
     r"mask must be a bool tensor of ids' shape \(2, 3\) \(the positions to score\), got torch.float32 \(2, 3\)"),
    ("token_logprobs (alone): mask shape",
     lambda: token_logprobs(HIDDEN, OutputHead(WEIGHT), TOKEN_IDS, mask=torch.ones(2, 2, dtype=torch.bool)),
     r"mask must be a bool tensor of ids' shape \(2, 3\) \(the positions to score\), got torch.bool \(2, 2\)"),
    ("SparseRLConfig: lower", lambda: SparseRLConfig(lower=1.5), r"`lower` must be in \(0, 1\], got 1\.5"),
    ("SparseRLConfig: veto", lambda: SparseRLConfig(veto_threshold=0.0),
     r"`veto_threshold` must be finite and > 0, got 0\.0"),
    ("SparseRLConfig: truncate", lambda: SparseRLConfig(truncate=NAN), r"`truncate` must be finite and >= 1, got nan"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "pattern"), [c[1:] for c in LOSS_ERRORS], ids=[c[0] for c in LOSS_ERRORS])
def test_loss_function_rejects(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
