"""Every supported decoder family, exactly: the lit_smd attention and output head against transformers' own.

Each family is a tiny random float64 model (4 layers, hidden 64, 4 query / 2 KV heads) with its distinctive features
switched on: Gemma 2's attention and final logit softcapping and alternating sliding windows, GPT-OSS's attention
sinks and sliding windows, Granite's attention / logits multipliers, Cohere's logit scale, the MoE routers of
Qwen3-MoE, GPT-OSS and DeepSeek-V2 (transformers' eager experts, which run in float64), DeepSeek-V2 / V3's multi-head
latent attention (MLA: one cached latent per layer expanded to every head, keys of 24 and values of 16 dimensions).
Per family:

* a rollout that evicts nothing (`SnapKV(1.0)`) samples with the log-probs of transformers' *eager* attention and
  forward on the same tokens (the independent reference; eager's softmax is float32 for most families, so the bound
  is float32 rounding, ~1e-6);
* the learner replays the rollout exactly (float64 rounding) under every compressor, per row and with the shared
  prompt packed once per group, while the dense view differs;
* distillation's exact (full-vocabulary) forward / reverse KL and the sampled estimator's k1 reward equal those of
  transformers' eager distributions of student and teacher (each through its own logit post-processing);
* one GRPO (SMD) step and one distillation step train the model with finite losses.
"""

import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

from lit_smd.datamodules import ScoredRollout
from lit_smd.kv import COMPRESSORS, H2O, PrefillThenDecode, SnapKV, ensure_attention
from lit_smd.learner import LEARNER_LAYOUTS, dense_hidden_states, learner_hidden_states, score
from lit_smd.losses.head import output_head
from lit_smd.modules.distill import DistillModule
from lit_smd.modules.grpo import GRPOModule
from lit_smd.rollout import Rollout, generate

from .kv.conftest import make_compressor

VOCAB = 103  # the tiny tokenizer of tests/conftest.py (distillation reads its text)
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "initializer_range": 0.35,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ALTERNATING = ["sliding_attention", "full_attention"] * 2
MLA = {
    "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "head_dim": 8, "v_head_dim": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
}  # fmt: skip
"""Multi-head latent attention: one head per query head, the config's ``head_dim`` is the rotary part of a key."""

FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gemma2": {
        "sliding_window": 8, "layer_types": ALTERNATING, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24,
    },
    "gemma3_text": {"sliding_window": 8, "layer_types": ALTERNATING, "final_logit_softcapping": 3.0},
    "gpt_oss": {"sliding_window": 8, "layer_types": ALTERNATING, "num_local_experts": 4, "num_experts_per_tok": 2},
    "phi3": {},
    "olmo2": {},
    "starcoder2": {},
    "granite": {
        "attention_multiplier": 0.5, "logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
    },
    "cohere": {"logit_scale": 0.5},
    "deepseek_v3": {**MLA, "first_k_dense_replace": 4},
    "deepseek_v2": {**MLA, "first_k_dense_replace": 1, "n_routed_experts": 4, "n_group": 2, "topk_group": 1},
}  # fmt: skip
"""Tested families (transformers model types) and the config switches that exercise their features."""

EAGER_TOLERANCE = 1e-5  # eager's float32 softmax; GPT-OSS (float64 softmax) agrees to ~1e-13
EXACT = 1e-12
FLOAT32_ROUNDING = {"deepseek_v2"}
"""Families whose transformers code rounds float64 activations to float32: DeepSeek-V2's rotary embedding (queries
and keys as complex64) and the DeepSeek routers (logits in float32). A float64 rollout and its replay then agree to
float32 rounding only (~1e-7; ~1e-14 with the rotary in float64 and dense layers): DeepSeek-V3 is tested with dense
layers, so that its MLA replay is held to `EXACT`, and DeepSeek-V2 with a mixture-of-experts layer."""


def exact(model_type: str) -> float:
    """Replay tolerance of a float64 model: float64 rounding, or float32 rounding where the model itself rounds."""
    return EAGER_TOLERANCE if model_type in FLOAT32_ROUNDING else EXACT


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type]})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation="lit_smd", dtype=torch.float32, experts_implementation="eager"
        )
    return model.to(torch.float64).eval()


def prompts(num_prompts: int = 2, width: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Random left-padded prompts (the second is 5 tokens shorter)."""
    ids = torch.randint(3, VOCAB, (num_prompts, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(num_prompts, width, dtype=torch.bool)
    mask[1:, :5] = False
    return ids.masked_fill(~mask, 0), mask


def sample(model, compressor, *, num_samples: int = 1, max_new_tokens: int = 10, seed: int = 1) -> Rollout:
    ids, mask = prompts()
    return generate(
        model, ids, mask, compressor=compressor, max_new_tokens=max_new_tokens, num_generations=num_samples,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def eager_distributions(model, rollout: Rollout) -> torch.Tensor:
    """``[B, N, V]`` next-token log-probs at the completion positions from transformers' eager attention and forward
    (its own logit post-processing included), one unpadded row at a time."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    rows = []
    for b in range(len(rollout)):
        prompt = rollout.prompt_ids[b][rollout.prompt_mask[b]]
        ids = torch.cat([prompt, rollout.completion_ids[b]])[None]  # [1, P + N]
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [N, V]
        rows.append(torch.log_softmax(logits.double(), -1))
    return torch.stack(rows)


def eager_logprobs(model, rollout: Rollout) -> torch.Tensor:
    """``[B, N]`` completion log-probs from transformers' eager attention and forward (`eager_distributions`)."""
    return eager_distributions(model, rollout).gather(-1, rollout.completion_ids[..., None])[..., 0]


@pytest.fixture(params=sorted(FAMILIES))
def model_type(request: pytest.FixtureRequest) -> str:
    return request.param


def test_keep_all_rollout_matches_transformers_eager(model_type):
    model = build(model_type)
    with pytest.warns(UserWarning, match="evicts nothing"):
        rollout = sample(model, SnapKV(1.0, window=4))
    mask = rollout.completion_mask
    gap = (rollout.logprobs - eager_logprobs(model, rollout))[mask].abs().max()
    assert gap <= EAGER_TOLERANCE, f"{model_type}: keep-all rollout vs transformers eager differs by {gap:.2e}"


def test_replay_is_exact_under_every_compressor_and_the_dense_view_differs(model_type):
    model = build(model_type)
    gaps = {}
    for name in sorted(COMPRESSORS):
        rollout = sample(model, make_compressor(name, budget=0.5), num_samples=2)
        mask = rollout.completion_mask
        with torch.no_grad():
            replay = score(model, rollout, shadow=True)
            packed = output_head(model)(learner_hidden_states(model, rollout, layout="shared_prefix").hidden)
            dense = score(model, rollout, shadow=False)
        packed = torch.log_softmax(packed, -1).gather(-1, rollout.completion_ids[..., None])[..., 0]
        bound = exact(model_type)
        assert (replay - rollout.logprobs)[mask].abs().max() <= bound, f"{model_type} / {name}: per-row replay"
        assert (packed - rollout.logprobs)[mask].abs().max() <= bound, f"{model_type} / {name}: shared-prefix replay"
        gaps[name] = float((dense - rollout.logprobs)[mask].abs().max())
    assert max(gaps.values()) > 1e-3, f"{model_type}: eviction never changed a log-prob ({gaps})"


def test_dense_teacher_reusing_the_prompt_is_the_dense_view(model_type):
    """SMD's dense teacher runs only the completions over the prompt keys / values the masked pass kept (both
    layouts): the dense view's log-probs, at float64 precision."""
    model = build(model_type)
    rollout = sample(model, make_compressor("snapkv", budget=0.5), num_samples=2)  # prefill drops: prompts shared
    mask = rollout.completion_mask
    head = output_head(model)
    with torch.no_grad():
        dense = score(model, rollout, shadow=False)
        for layout in LEARNER_LAYOUTS:
            masked = learner_hidden_states(model, rollout, layout=layout, keep_prompt_kv=True)
            assert masked._row_prompt_kv or masked._packing.plan.prompt_kv, f"{layout}: no prompt keys kept"
            logits = head(dense_hidden_states(model, rollout, masked))  # [B, N, V]
            teacher = torch.log_softmax(logits, -1).gather(-1, rollout.completion_ids[..., None])[..., 0]
            gap = (teacher - dense)[mask].abs().max()
            assert gap <= exact(model_type), f"{model_type} / {layout}: dense teacher vs dense view {gap:.2e}"


def _trainer() -> L.Trainer:
    return L.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
        enable_model_summary=False,
    )  # fmt: skip


def _parameters(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _changed(before, model) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-2)


def test_one_grpo_step(model_type):
    policy = build(model_type)
    compressor = PrefillThenDecode(SnapKV(0.5, window=4), H2O(0.5, window=2))
    rollout = sample(policy, compressor, num_samples=2, max_new_tokens=6)
    module = GRPOModule(policy, mode="smd", compressor=compressor, optimizer=_sgd, logits_chunk_size=7)
    experience = module.make_experience(ScoredRollout(rollout, torch.tensor([0.0, 1.0, 1.0, 0.0]), num_generations=2))
    before = _parameters(policy)
    trainer = _trainer()
    trainer.fit(module, train_dataloaders=DataLoader([experience], batch_size=None))
    assert _changed(before, policy)
    metrics = trainer.callback_metrics
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())
    assert float(metrics["mismatch/logprob_abs_diff_max"]) <= exact(model_type)


def test_one_distillation_step(model_type, tokenizer):
    from tests.modules.test_distill_module import data

    student, teacher = build(model_type, seed=0), build(model_type, seed=1)
    before, teacher_before = _parameters(student), _parameters(teacher)
    module = DistillModule(student, teacher, max_new_tokens=4, optimizer=_sgd, logits_chunk_size=5)
    trainer = _trainer()
    trainer.fit(module, data(tokenizer))
    assert _changed(before, student) and not _changed(teacher_before, teacher)
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in trainer.callback_metrics.values())


def test_every_tested_family_routes_attention_through_lit_smd(model_type):
    model = build(model_type)
    ensure_attention(model)
    assert model.config._attn_implementation == "lit_smd"


def test_sampled_distillation_scores_the_teacher_with_its_output_head(model_type):
    """The sampled estimator's reward ``log p_T - log q_S`` uses each model's logit post-processing (Gemma's final
    softcap, Granite's ``logits_scaling``, Cohere's ``logit_scale``): its logged k1 estimate equals the one from
    transformers' eager forwards of student and teacher on the same tokens."""
    student, teacher = build(model_type, seed=0), build(model_type, seed=1)
    rollout = sample(student, None, num_samples=2, max_new_tokens=6)
    module = DistillModule(student, teacher, estimator="sampled", forward_weight=0.0, reverse_weight=1.0,
                           max_new_tokens=6)  # fmt: skip
    _, metrics = module.distill_loss(rollout)
    k1 = eager_logprobs(student, rollout) - eager_logprobs(teacher, rollout)  # [B, N]
    expected = k1[rollout.completion_mask].mean()
    assert abs(float(metrics["distill/reverse_kl"]) - float(expected)) <= EAGER_TOLERANCE


def test_full_distillation_kl_matches_transformers_eager(model_type):
    """The exact estimator's forward and reverse token KL (teacher and student through their own output heads) equal
    the KLs of transformers' eager next-token distributions on the same tokens."""
    student, teacher = build(model_type, seed=0), build(model_type, seed=1)
    rollout = sample(student, None, num_samples=2, max_new_tokens=6)
    module = DistillModule(student, teacher, estimator="full", forward_weight=0.5, reverse_weight=0.5,
                           max_new_tokens=6, logits_chunk_size=5)  # fmt: skip
    _, metrics = module.distill_loss(rollout)
    log_q, log_p = eager_distributions(student, rollout), eager_distributions(teacher, rollout)  # [B, N, V] each
    mask = rollout.completion_mask
    forward = (log_p.exp() * (log_p - log_q)).sum(-1)[mask].mean()
    reverse = (log_q.exp() * (log_q - log_p)).sum(-1)[mask].mean()
    assert abs(float(metrics["distill/forward_kl"]) - float(forward)) <= EAGER_TOLERANCE
    assert abs(float(metrics["distill/reverse_kl"]) - float(reverse)) <= EAGER_TOLERANCE
