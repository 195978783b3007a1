"""Where `lit_smd.modules.DistillModule`'s prefixes come from, besides the mix coin (the module's
``_draw_student_prefix``): sampling from the student or the teacher, and cached teacher trajectories cut to the
current ``max_new_tokens``.

Sampling stops at the union of the data side's EOS ids and the model's own ``generation_config.eos_token_id``; the
seeds of the coin and of the sampling are `seed_of` ``(sampling_seed, global_step, batch_idx, ...)``, so a resumed
run draws what the original run would have.
"""

from dataclasses import replace

import torch
from torch import Tensor
from transformers import PreTrainedModel

from lit_smd.datamodules.distill import PromptBatch
from lit_smd.datamodules.teacher_cache import CachedBatch
from lit_smd.fsdp import gathered
from lit_smd.rollout import Rollout, generate


def generate_prefixes(
    model: PreTrainedModel,
    prompts: PromptBatch,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
) -> Rollout:
    """``model``'s sampled completions of ``prompts`` (`lit_smd.rollout.generate`; under FSDP2 the whole model)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    stop = sorted({*prompts.eos_token_ids, *(i for i in configured if i is not None)})  # id 0 is a real EOS (Pythia)
    with gathered(model, layers=True):  # FSDP2: the whole model for the decode loop
        return generate(
            model, prompts.prompt_ids, prompts.prompt_mask, max_new_tokens=max_new_tokens,
            temperature=temperature, eos_token_id=stop,
            pad_token_id=prompts.pad_token_id, generator=generator,
        )  # fmt: skip


def truncate_cached(batch: CachedBatch, limit: int) -> tuple[Rollout, tuple[Tensor, Tensor]]:
    """The cached trajectories cut at ``limit`` tokens (cut ones marked ``"length"``) and their top-k."""
    rollout = batch.rollout
    if rollout.completion_ids.shape[1] <= limit:
        return rollout, (batch.topk_ids, batch.topk_logprobs)
    cut = (rollout.completion_lengths > limit).tolist()
    rollout = replace(
        rollout,
        completion_ids=rollout.completion_ids[:, :limit],
        completion_mask=rollout.completion_mask[:, :limit],
        logprobs=rollout.logprobs[:, :limit],
        finish_reason=["length" if c else reason for c, reason in zip(cut, rollout.finish_reason, strict=True)],
    )
    return rollout, (batch.topk_ids[:, :limit], batch.topk_logprobs[:, :limit])


def seed_of(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (the hash of an int tuple does not depend on PYTHONHASHSEED)."""
    return hash(parts) % 2**63
