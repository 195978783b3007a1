"""Sampling from any Hugging Face causal LM under a compressed KV cache, into a `Rollout`.

`generate` owns its prefill/decode loop (``model.generate`` rejects the extra keyword arguments the attention
function needs): left-padded prompts are prefilled once, in micro-batches of ``prefill_batch_size`` prompts, each
compressed into the cache before the next runs (so the peak memory is one micro-batch's prefill plus the budgeted
cache of all rows); the cache is shared by ``num_generations`` completions per prompt, and each step samples every row
with one generator (randomised compressors draw from it too), so a seeded rollout is reproducible. With a
compressor it returns the `ShadowMask` of what each token could see.

`lit_smd.learner` scores a `Rollout` teacher-forced: replaying the shadow mask it reproduces the rollout's log-probs
up to float reduction order (the learner's view of SMD), or it scores densely.

Log-probs, here and everywhere in lit_smd, are of the temperature-scaled *full-vocabulary* distribution.
top-k / top-p truncation changes what is sampled, not the recorded log-prob, so with truncation the recorded
values are not the sampler's exact probabilities (the same convention as vLLM's ``processed_logprobs`` off).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from lit_smd._deprecation import moved, renamed_kwargs
from lit_smd.kv.attention import ensure_attention
from lit_smd.kv.budget import resolve_budget
from lit_smd.kv.cache import BudgetedCache
from lit_smd.kv.compressors import Compressor, SnapKV
from lit_smd.kv.features import softmax_dtype
from lit_smd.kv.shadow import ShadowMask
from lit_smd.losses.head import output_head

__all__ = ["Rollout", "generate", "prefill", "sample_tokens"]

__getattr__ = moved(__name__, {"score": "lit_smd.learner.score"})  # deprecated in 0.2.0


@dataclass
class Rollout:
    """A batch of sampled completions. Rows of the same prompt are consecutive (``num_generations`` each).

    Attributes:
        prompt_ids: ``[B, P]`` left-padded prompt tokens.
        prompt_mask: ``[B, P]`` bool, True on real prompt tokens.
        completion_ids: ``[B, N]`` sampled tokens; padded after EOS.
        completion_mask: ``[B, N]`` bool, True on real completion tokens (EOS included).
        logprobs: ``[B, N]`` float: log-prob of each sampled token under the temperature-scaled
            full-vocabulary distribution of the rollout policy (0 where the mask is False).
        finish_reason: ``B`` strings, ``"eos"`` or ``"length"``.
        shadow_mask: Eviction record of a compressed rollout, None for a dense one.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: list[str]
    shadow_mask: ShadowMask | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return self.prompt_mask.sum(dim=1)

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)

    @property
    def truncated(self) -> torch.Tensor:
        """``[B]`` bool: the completion hit ``max_new_tokens`` without EOS."""
        return torch.tensor([reason == "length" for reason in self.finish_reason], device=self.prompt_ids.device)

    def to(self, device: torch.device | str) -> Rollout:
        tensors = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name not in _NOT_TENSORS}
        shadow = None if self.shadow_mask is None else self.shadow_mask.to(device)
        return replace(self, **tensors, shadow_mask=shadow)

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> Rollout:
        """The rows ``index`` (a slice, indices or a bool mask) as a new rollout."""
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
        else:
            index = torch.as_tensor(index)
            rows = index.nonzero().flatten().tolist() if index.dtype == torch.bool else index.flatten().tolist()
        picked = torch.tensor(rows, dtype=torch.long, device=self.prompt_ids.device)
        tensors = {f.name: getattr(self, f.name)[picked] for f in fields(self) if f.name not in _NOT_TENSORS}
        shadow = None if self.shadow_mask is None else self.shadow_mask.select(picked)
        return replace(self, **tensors, finish_reason=[self.finish_reason[r] for r in rows], shadow_mask=shadow)

    def __getitem__(self, index: torch.Tensor | slice | Sequence[int]) -> Rollout:
        return self.select(index)

    @staticmethod
    def cat(rollouts: Sequence[Rollout], pad_token_id: int = 0) -> Rollout:
        """Concatenate along the batch: prompts are re-padded on the left, completions on the right."""
        if not rollouts:
            raise ValueError("Rollout.cat needs at least one rollout")
        if len({r.shadow_mask is None for r in rollouts}) > 1:
            raise ValueError("Rollout.cat cannot mix rollouts with and without a shadow mask")
        width = max(r.prompt_ids.shape[1] for r in rollouts)
        new = max(r.completion_ids.shape[1] for r in rollouts)

        def left(x: torch.Tensor, value) -> torch.Tensor:
            return F.pad(x, (width - x.shape[1], 0), value=value)

        def right(x: torch.Tensor, value) -> torch.Tensor:
            return F.pad(x, (0, new - x.shape[1]), value=value)

        shadows = [r.shadow_mask for r in rollouts]
        return Rollout(
            prompt_ids=torch.cat([left(r.prompt_ids, pad_token_id) for r in rollouts]),
            prompt_mask=torch.cat([left(r.prompt_mask, False) for r in rollouts]),
            completion_ids=torch.cat([right(r.completion_ids, pad_token_id) for r in rollouts]),
            completion_mask=torch.cat([right(r.completion_mask, False) for r in rollouts]),
            logprobs=torch.cat([right(r.logprobs, 0.0) for r in rollouts]),
            finish_reason=[reason for r in rollouts for reason in r.finish_reason],
            shadow_mask=None if shadows[0] is None else ShadowMask.cat(shadows),
        )

    def save(self, path: str | Path) -> None:
        """Write the rollout to ``path`` (``torch.save`` of plain tensors, loadable with ``weights_only``)."""
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "shadow_mask"}
        state["shadow_evict_steps"] = None if self.shadow_mask is None else self.shadow_mask.evict_steps
        torch.save(state, path)

    @classmethod
    def load(cls, path: str | Path, map_location: torch.device | str = "cpu") -> Rollout:
        """Read a rollout written by `save`."""
        state = torch.load(path, map_location=map_location, weights_only=True)
        steps = state.pop("shadow_evict_steps")
        return cls(**state, shadow_mask=None if steps is None else ShadowMask(steps))


_NOT_TENSORS = ("finish_reason", "shadow_mask")


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: ``[B, V]`` next-token logits.
        temperature: Softmax temperature (> 0).
        top_k: Keep the ``top_k`` most likely tokens (0 = all).
        top_p: Nucleus sampling mass (1.0 = all).
        generator: Random generator on the logits' device.

    Returns:
        ``(tokens [B], logprobs [B])``; the log-probs are of the temperature-scaled full distribution.
    """
    dtype = softmax_dtype(logits.dtype)
    logprobs = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)  # [B, V]
    filtered = logprobs
    if top_k > 0:
        kth = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1).values[:, -1:]  # [B, 1]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = filtered.sort(dim=-1, descending=True)
        mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()  # [B, V] mass of more likely tokens
        drop = torch.zeros_like(filtered, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
        filtered = filtered.masked_fill(drop, float("-inf"))
    tokens = torch.multinomial(filtered.exp(), 1, generator=generator)  # [B, 1]
    return tokens.squeeze(1), logprobs.gather(-1, tokens).squeeze(1)


def check_sampling_settings(max_new_tokens: int, temperature: float | None, prefill_batch_size: int) -> None:
    """Check the settings every sampler of `generate` shares (``temperature`` None: the caller's default).

    Raises:
        ValueError: ``max_new_tokens`` or ``prefill_batch_size`` not an integer >= 1, ``temperature`` not finite and
            > 0.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if temperature is not None and not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    if isinstance(prefill_batch_size, bool) or not isinstance(prefill_batch_size, int) or prefill_batch_size < 1:
        raise ValueError(f"prefill_batch_size must be an integer >= 1 (prompts per prefill forward), got "
                         f"{prefill_batch_size!r}")


def _check_generate_args(
    model, input_ids, attention_mask, compressor, max_new_tokens, temperature, top_p, top_k, num_generations,
    prefill_batch_size,
) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [batch, prompt_length], got {type(input_ids).__name__}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): nothing to generate from")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    check_sampling_settings(max_new_tokens, temperature, prefill_batch_size)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    mask = attention_mask.bool()
    if bool((mask.sum(dim=1) == 0).any()):
        raise ValueError("attention_mask has a row with no real token: every prompt needs at least one token")
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError("prompts must be left-padded: attention_mask rows must look like [0, ..., 0, 1, ..., 1]")
    if compressor is not None:
        if not isinstance(compressor, Compressor):
            raise ValueError(f"compressor must be one of lit_smd.kv.COMPRESSORS or None, got {compressor!r}")
        shortest = int(mask.sum(dim=1).min())
        if shortest < compressor.min_prompt_length:
            name = "SnapKV" if isinstance(compressor, SnapKV) else type(compressor).__name__
            # A paper-mode budget too small for the prompt explains itself; else it is SnapKV's window.
            resolve_budget(compressor.budget, mask.sum(dim=1), max_new_tokens, compressor.min_budget,
                           type(compressor).__name__, compressor.budget_mode)
            raise ValueError(
                f"a prompt of {shortest} tokens is shorter than the {name} observation window "
                f"({compressor.min_prompt_length}); lower the window or filter short prompts"
            )
    ensure_attention(model)
    output_head(model)  # refuses unknown logit post-processing before any model work
    vocab_size = model.get_input_embeddings().num_embeddings
    used = input_ids[mask]
    if bool(((used < 0) | (used >= vocab_size)).any()):
        raise ValueError(
            f"input_ids hold token ids in [{int(used.min())}, {int(used.max())}] but the model embeds only ids "
            f"[0, {vocab_size}): the tokenizer does not belong to the model"
        )


@torch.no_grad()
def prefill(
    model: torch.nn.Module, cache: BudgetedCache, input_ids: torch.Tensor, prefill_batch_size: int
) -> torch.Tensor:
    """Prefill ``input_ids`` into ``cache`` in micro-batches of prompts; each is compressed before the next runs.

    Args:
        model: The causal LM (lit_smd attention).
        cache: A fresh `BudgetedCache` built for these prompts.
        input_ids: ``[B, P]`` left-padded prompts.
        prefill_batch_size: Prompts per forward; the leading pad columns a micro-batch shares are skipped.

    Returns:
        ``[B, V]`` next-token logits after each prompt, from the model's own forward (its logit post-processing
            included; `lit_smd.losses.head.output_head` computes the same for the learner).
    """
    logits = []
    # A "prepared" 4-D mask, so transformers builds none (for sliding-window models it would build [m, 1, W, W]):
    # the budgeted cache masks by logical position itself.
    no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
    for start in range(0, input_ids.shape[0], prefill_batch_size):
        batch = cache.begin_prefill(start, min(start + prefill_batch_size, input_ids.shape[0]))
        width = batch.positions.shape[1]
        out = model(
            input_ids=input_ids[batch.start : batch.stop, -width:], attention_mask=no_mask,
            position_ids=batch.positions.clamp(min=0), cache=cache, budgeted_cache=cache, use_cache=True,
            logits_to_keep=1,
        )
        logits.append(out.logits[:, -1])
        del out
    cache.end_prefill()
    return torch.cat(logits)


@renamed_kwargs(num_samples="num_generations")  # deprecated in 0.2.0
@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    compressor: Compressor | None = None,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_generations: int = 1,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    prefill_batch_size: int = 1,
) -> Rollout:
    """Sample completions with a (possibly compressed) KV cache.

    The model runs in eval mode under ``no_grad`` (its training flag is restored afterwards) and is switched to
    the ``lit_smd`` attention implementation if it is not already.

    Args:
        model: A Hugging Face causal LM whose attention goes through transformers' ``AttentionInterface``.
        input_ids: ``[B, P]`` left-padded prompts.
        attention_mask: ``[B, P]``, 1 on real tokens.
        compressor: KV compressor (`lit_smd.kv.COMPRESSORS`), or None for a dense rollout.
        max_new_tokens: Decode steps at most.
        temperature: Sampling temperature; log-probs are of the temperature-scaled distribution.
        top_p: Nucleus sampling mass.
        top_k: Top-k sampling (0 = off).
        num_generations: Completions per prompt (G); rows ``i * G ... (i + 1) * G - 1`` belong to prompt ``i``. The
            prefill runs once per prompt.
        eos_token_id: Token id(s) that end a completion.
        pad_token_id: Fills completions after EOS (default: the first EOS id, else 0).
        generator: Random generator on the model's device; seeds the sampling and `RandomEviction`.
        prefill_batch_size: Prompts prefilled per forward. Each micro-batch is compressed into the cache before
            the next runs, so the prefill's activation peak is that of ``prefill_batch_size`` prompts; the default
            (1) gives the smallest peak and skips every pad column. Larger values batch short prompts (faster on
            GPUs) at the price of a larger peak.

    Returns:
        A `Rollout` with ``B * num_generations`` rows.

    Raises:
        ValueError: Malformed inputs (checked before any model work).
        TypeError: The model does not support transformers' attention interface.
    """
    _check_generate_args(
        model, input_ids, attention_mask, compressor, max_new_tokens, temperature, top_p, top_k, num_generations,
        prefill_batch_size,
    )
    eos_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    pad_id = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    device = input_ids.device
    prompt_mask = attention_mask.bool()
    cache = BudgetedCache(
        model.config.num_hidden_layers, compressor, prompt_mask, max_new_tokens, num_generations, generator=generator
    )
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # as in `prefill`: transformers builds no mask

    was_training = model.training
    model.eval()
    try:
        logits = prefill(model, cache, input_ids, prefill_batch_size)  # [B, V]
        logits = logits.repeat_interleave(num_generations, dim=0)  # [B * G, V]
        rows = logits.shape[0]
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        tokens, logprobs, masks = [], [], []
        for step in range(max_new_tokens):
            token, logprob = sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                           generator=generator)
            alive = ~finished
            tokens.append(torch.where(alive, token, pad_id))
            logprobs.append(torch.where(alive, logprob, 0.0))
            masks.append(alive)
            finished = finished | torch.isin(token, eos)
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            position = cache.decode_position(cache.prompt_width + step)[:, None]  # [B*S, 1]
            out = model(
                input_ids=tokens[-1][:, None], attention_mask=no_mask, position_ids=position, cache=cache,
                budgeted_cache=cache, use_cache=True,
            )
            logits = out.logits[:, -1]
    finally:
        model.train(was_training)

    return Rollout(
        prompt_ids=input_ids.repeat_interleave(num_generations, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
        completion_ids=torch.stack(tokens, dim=1),
        completion_mask=torch.stack(masks, dim=1),
        logprobs=torch.stack(logprobs, dim=1),
        finish_reason=["eos" if done else "length" for done in finished.tolist()],
        shadow_mask=None if compressor is None else cache.shadow_mask(len(tokens)),
    )
