"""Sampling from any Hugging Face causal LM under a compressed KV cache, into a `Rollout`.

`generate` owns its prefill/decode loop (``model.generate`` rejects the extra keyword arguments the attention
function needs): left-padded prompts are prefilled once, in micro-batches of ``prefill_batch_size`` prompts, each
compressed into the cache before the next runs (so the peak memory is one micro-batch's prefill plus the budgeted
cache of all rows); the cache is shared by ``num_generations`` completions per prompt. Each step draws its sampling
noise (and a randomised compressor's) from one generator for every row of the batch, so a seeded rollout is
reproducible, whichever rows are still decoding. With a compressor it returns the `ShadowMask` of what each token could
see.

The decode loop is shaped for accelerators: no host sync between its reads of which rows ended (one every
``sync_every`` steps), ended rows compacted out of the batch at those reads, attention over the occupied slots
(bucketed), and a step that ``torch.compile(fullgraph=True)`` traces whole (``compile=True``; CUDA graphs on CUDA).

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

__all__ = ["Rollout", "compiled_decode_step", "exponential_noise", "generate", "prefill", "sample_tokens"]

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
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row, with no host sync.

    The token is the first to arrive in an exponential race: the argmax of ``p_i / E_i`` over the kept tokens, with
    ``E_i`` standard exponential noise, which samples the (truncated) distribution ``p`` exactly as multinomial
    sampling does, from noise the caller may draw for rows that are not in ``logits``.

    Args:
        logits: ``[B, V]`` next-token logits.
        temperature: Softmax temperature (> 0).
        top_k: Keep the ``top_k`` most likely tokens (0 = all).
        top_p: Nucleus sampling mass (1.0 = all).
        generator: Random generator on the logits' device (draws ``noise`` when it is not given).
        noise: ``[B, V]`` standard exponential noise (`exponential_noise`); default: drawn from ``generator``.

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
    if noise is None:
        noise = exponential_noise(logits.shape[0], logits.shape[1], dtype, logits.device, generator)
    tokens = (filtered - noise.to(dtype).log()).argmax(dim=-1)  # [B]: log p_i - log E_i, largest wins
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(1)


def exponential_noise(
    rows: int, vocab: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """``[rows, vocab]`` standard exponential noise for `sample_tokens` (bounded away from 0, so its log is finite)."""
    noise = torch.empty(rows, vocab, dtype=dtype, device=device).exponential_(generator=generator)
    return noise.clamp_(min=torch.finfo(dtype).tiny)


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


def _decode_forward(
    model: torch.nn.Module, cache: BudgetedCache, token: torch.Tensor, position: torch.Tensor, no_mask: torch.Tensor
) -> torch.Tensor:
    """One decode step: the forward of ``token [R]`` at ``position [R]`` over the cache -> next logits ``[R, V]``.

    Host-sync free and free of Python state that varies per step (the step's schedule is in ``cache.step``), so
    ``torch.compile(_decode_forward, fullgraph=True)`` traces it whole.
    """
    out = model(
        input_ids=token[:, None], attention_mask=no_mask, position_ids=position[:, None], cache=cache,
        budgeted_cache=cache, use_cache=True,
    )
    return out.logits[:, -1]


_COMPILED: dict[str, object] = {}


def compiled_decode_step(options: dict | None = None, device_type: str = "cpu"):
    """`_decode_forward` under ``torch.compile(fullgraph=True)``, built once per set of options.

    Args:
        options: Extra keyword arguments of ``torch.compile`` (e.g. ``{"backend": "eager"}``); default: inductor,
            with ``mode="reduce-overhead"`` (CUDA graphs) on CUDA.
        device_type: The model's device type.
    """
    options = dict(options or {})
    if device_type == "cuda" and "backend" not in options:
        options.setdefault("mode", "reduce-overhead")
    key = repr(sorted(options.items()))  # option values may be unhashable (e.g. inductor's ``options`` dict)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_decode_forward, fullgraph=True, **options)
    return _COMPILED[key]


DECODE_RECOMPILE_LIMIT = 64
"""Compilations of the compiled decode step allowed in a process (each model, compressor and dtype compiles its own
few graphs: static, dynamic width, dynamic rows); past it `generate(compile=...)` raises instead of running eager."""


def _call_compiled_step(step_fn, model, cache: BudgetedCache, token: torch.Tensor, no_mask: torch.Tensor):
    """The compiled decode step under `DECODE_RECOMPILE_LIMIT` (torch's default, 8, is shared by every compiled
    function and would stop a run that samples with two models or compressors)."""
    try:
        with torch._dynamo.config.patch(recompile_limit=DECODE_RECOMPILE_LIMIT):
            return step_fn(model, cache, token, cache.step.newest, no_mask)
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        raise RuntimeError(
            f"generate(compile=...) reached lit_smd.rollout.DECODE_RECOMPILE_LIMIT={DECODE_RECOMPILE_LIMIT} "
            "compilations of the decode step in this process; raise the limit or pass compile=False"
        ) from error


ROW_QUANTUM = 8
"""Compaction keeps a multiple of this many rows (padding with ended rows): CPU BLAS kernels compute a row the same
way in any batch whose size is a multiple of their row tile (4 here, measured), not in a partial tile."""


def _rows_to_keep(done: list[bool], pow2: bool) -> list[int] | None:
    """Active rows to keep after a host read, None to keep them all.

    The unfinished rows, padded with ended ones up to a multiple of `ROW_QUANTUM`, or (``pow2``, compiled steps) up to
    a power of two, so that a compiled step meets at most ``log2(rows) + 1`` batch sizes.
    """
    alive = [i for i, d in enumerate(done) if not d]
    target = max(len(alive), 1)
    target = 1 << (target - 1).bit_length() if pow2 else -(-target // ROW_QUANTUM) * ROW_QUANTUM
    target = max(target, ROW_QUANTUM)
    if target >= len(done):
        return None
    alive += [i for i, d in enumerate(done) if d][: target - len(alive)]
    return sorted(alive)


def _check_decode_options(sync_every: int, compact: bool, compile: bool | dict) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1 (decode steps between host reads), got {sync_every!r}")
    if not isinstance(compact, bool):
        raise ValueError(f"compact must be True or False, got {compact!r}")
    if not isinstance(compile, (bool, dict)):
        raise ValueError(f"compile must be True, False or a dict of torch.compile options, got {compile!r}")


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
    sync_every: int = 16,
    compact: bool = True,
    compile: bool | dict = False,
) -> Rollout:
    """Sample completions with a (possibly compressed) KV cache.

    The model runs in eval mode under ``no_grad`` (its training flag is restored afterwards) and is switched to
    the ``lit_smd`` attention implementation if it is not already.

    The decode loop never waits for the device between its host reads, one every ``sync_every`` steps: end-of-sequence
    is tracked on the device, the budget schedule was computed when the cache was built, eviction is tensor
    operations, and tokens are sampled by an exponential race (`sample_tokens`) from noise drawn for every row of the
    batch. At each read, the loop stops if every row has ended, and (``compact``) rows that ended leave the batch:
    the cache drops their slots, so the rest of the rollout costs what its unfinished rows cost. The same seeded call
    gives the same tokens, log-probs and shadow mask for any ``sync_every``, and with or without compaction: bit for
    bit where the matrix products compute a row alike in every batch whose size is a multiple of `ROW_QUANTUM` (the
    CPU's do; compaction keeps such sizes), else (GPU kernels chosen by batch size) up to float rounding.

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
        sync_every: Decode steps between two host reads of which rows have ended (the loop's only host syncs).
            Up to ``sync_every - 1`` steps may run after the last row ended; their output is discarded.
        compact: Drop ended rows from the batch at each host read.
        compile: Run each decode step through ``torch.compile(fullgraph=True)`` (on CUDA with
            ``mode="reduce-overhead"``, i.e. CUDA graphs); a dict gives further ``torch.compile`` options. The
            attended slots are bucketed (`lit_smd.kv.cache.slot_bucket`) and, compiled, the rows are compacted to
            powers of two, so a rollout meets a bounded number of shapes.

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
    _check_decode_options(sync_every, compact, compile)
    eos_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    pad_id = pad_token_id if pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    device = input_ids.device
    prompt_mask = attention_mask.bool()
    cache = BudgetedCache(
        model.config.num_hidden_layers, compressor, prompt_mask, max_new_tokens, num_generations, generator=generator
    )
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # as in `prefill`: transformers builds no mask
    step_fn = _decode_forward
    if compile is not False:
        step_fn = compiled_decode_step(compile if isinstance(compile, dict) else None, device.type)
    cudagraphs = compile is not False and device.type == "cuda"  # marking steps is harmless without CUDA graphs

    was_training = model.training
    model.eval()
    try:
        logits = prefill(model, cache, input_ids, prefill_batch_size)  # [B, V]
        logits = logits.repeat_interleave(num_generations, dim=0)  # [R, V]
        rows, vocab = logits.shape
        dtype = softmax_dtype(logits.dtype)
        tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)  # [R, N]
        logprobs = torch.zeros(rows, max_new_tokens, dtype=dtype, device=device)
        masks = torch.zeros(rows, max_new_tokens, dtype=torch.bool, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)  # [R'] of the active rows `cache.rows`
        for step in range(max_new_tokens):
            active = cache.rows  # [R'] rows of the rollout still decoding
            noise = exponential_noise(rows, vocab, dtype, device, generator)  # every row: draws independent of R'
            if len(active) < rows:
                noise = noise.index_select(0, active)
            token, logprob = sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p, noise=noise)
            alive = ~finished
            token = torch.where(alive, token, pad_id)
            tokens[:, step].index_copy_(0, active, token)
            logprobs[:, step].index_copy_(0, active, torch.where(alive, logprob, 0.0))
            masks[:, step].index_copy_(0, active, alive)
            finished = finished | torch.isin(token, eos)
            if step == max_new_tokens - 1:
                break
            if (step + 1) % sync_every == 0:
                done = finished.tolist()  # the host read of these `sync_every` steps
                if all(done):
                    break
                keep = _rows_to_keep(done, pow2=compile is not False) if compact else None
                if keep is not None:
                    index = torch.tensor(keep, dtype=torch.long, device=device)
                    cache.compact(index)
                    finished, token = finished.index_select(0, index), token.index_select(0, index)
            cache.prepare_step(step, finished)
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            if compile is False:
                logits = step_fn(model, cache, token, cache.step.newest, no_mask)
            else:
                logits = _call_compiled_step(step_fn, model, cache, token, no_mask)
    finally:
        model.train(was_training)

    lengths = masks.sum(dim=1)  # [R]
    last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    ended, width = torch.isin(last, eos).tolist(), int(lengths.max())
    return Rollout(
        prompt_ids=input_ids.repeat_interleave(num_generations, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
        completion_ids=tokens[:, :width],
        completion_mask=masks[:, :width],
        logprobs=logprobs[:, :width],
        finish_reason=["eos" if done else "length" for done in ended],
        shadow_mask=None if compressor is None else cache.shadow_mask(width),
    )
