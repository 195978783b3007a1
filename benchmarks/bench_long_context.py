"""Long context: the GRPO learner step's peak memory and time over prompt and completion length, per mode and layout.

One cell = one model, one sweep (long prompt with a short completion, or short prompt with a long completion), one
length and one learner layout. Every step is the code of `lit_smd.modules.GRPOModule.training_step` on one on-policy
batch, called through the same functions (`lit_smd.modules._grpo_smd.grpo_pass`, which runs
`lit_smd.learner.learner_hidden_states`; the chunked log-prob head `lit_smd.losses.token_logprobs_and_entropy`, for
``smd`` `lit_smd.losses.token_logprobs` without gradient, over the completion tokens only, as the module projects them;
`lit_smd.losses.group_advantages` and `lit_smd.losses.policy_loss`; for ``smd`` the shadow-masked pass plus
`lit_smd.modules._grpo_smd.smd_loss_and_kl`, the KL to the no-grad dense teacher `lit_smd.learner.dense_hidden_states`
with the policy gradient pushed through the head in the same pass), then ``loss.backward()``. No optimizer step.

- **peak MiB**: per mode, a **fresh subprocess** builds the seeded model and the rollout, runs a small warm-up step
  (in bfloat16 on the CPU also the measured step once: `keeps_kernels_per_shape`), then one step: the resident
  high-water mark during it (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident size before it
  (model, rollout and inputs already built), under glibc's 64 KiB mmap threshold (freed tensors go back to the OS); on
  CUDA ``torch.cuda.max_memory_allocated`` above ``memory_allocated`` before the step.
- **time**: one more fresh subprocess per cell (``--rounds`` of them) builds the model once and every mode's rollout,
  warms each mode up (a small step, then a full-size step, each mode), then runs ``--repeats`` repeats
  of one step per mode in turns (the order reversed every other repeat), under glibc's allocator as a training
  process has it (32 MiB threshold: the 64 KiB one's page faults would tax block-heavy code, SMD's most). A mode's
  time is the median of its steps; its ratio to dense is the median of the ratios of each step to the dense step
  beside it, shown with their range. On a shared CPU one process can run 30-50% slower than the next for the same
  step, so ratios between steps of different processes (an earlier version of this benchmark) were off by that much;
  beside each other in one process they agree to about 10%.
- **phases** (``--phases``): the timing workers also time each phase of every step (`PHASES`: the learner pass, the
  log-prob head and policy loss, SMD's dense teacher, the KL's pass over the vocabulary, the backward), the device
  synchronised at each phase's end; a table gives each phase's median over the cell's median dense step, so SMD's
  extra work reads as shares of a dense step.
- **slope**: least-squares slope of log(peak) against log(length) over the lengths measured within
  ``--slope-range`` (default 4k..32k), per model, sweep, mode and layout (1 = linear, 2 = quadratic).

Modes: ``dense`` (a dense rollout, no shadow mask; dense learner view), ``naive`` (a compressed rollout, dense learner
view: the same learner work as dense, with the rollout's shadow mask carried along unused), ``smd`` (the shadow-masked
view, plus the dense no-grad teacher and the chunked full-vocabulary KL, ``kl_coef`` ``--kl-coef``). Layouts:
``shared_prefix`` (GRPO's default: one packed row ``[prompt | c_1 | ... | c_G]`` per group) and ``per_row`` (one row
per sample: ``score()``, ``learner_layout="per_row"``, fallback rows, and SMD under FSDP2).

**The shadow masks are synthetic.** Sampling a compressed rollout of 8-32k tokens is far too slow on a CPU, so each
cell's `lit_smd.rollout.Rollout` has random token ids and a `lit_smd.kv.ShadowMask` that mimics SnapKV-then-H2O in
``paper`` budget mode at ``--budget`` (see `synthetic_evict_steps`): the prefill drops ``P - floor(r P)`` prompt keys
outside the last ``--window`` positions at ``e = P`` (the same keys for every sample of a prompt), and decoding
evicts one key whenever the cache would exceed ``floor(r (i + 1))``: the decode key just leaving the recent window
(lifetime ``window + 1`` plus a little jitter, H2O's behaviour on fresh low-score keys) or, with probability ``q``,
a random surviving prompt key (never one of the first ``--sinks``). ``q`` and the decode lifetimes are calibrated
at the start of the run on a **real** SnapKV-then-H2O rollout (`lit_smd.rollout.generate`, tiny model,
``--calibration-lengths``); the run prints the real rollout's figures beside the synthetic mask's at the same size,
and every cell's visible fraction.

Memory guard: before a cell, its peak is predicted from the same series' shorter lengths (the slope of the last two,
at least 1; 2 with one point) and the cell is skipped when the prediction passes the memory limit
(``--memory-limit-gib``, capped by ``MemAvailable`` minus a margin at the time); a watchdog kills a worker whose
resident size passes the limit, or that runs longer than ``--max-seconds``. A skipped, killed or timed-out cell is
named as such in the tables, and the longer lengths of its series are skipped.

``--issue-table`` reproduces issue #28's table instead: tiny Qwen3 (2 layers, hidden 64, 4/2 heads, vocab 256), one
256-token prompt x 2 samples, 1024 and 4096 completion tokens, one learner pass with gradient (the pass, the chunked
log-prob head and ``backward`` of the summed completion log-probs; no KL) per layout and view, and ``score(model,
rollout, shadow=True / False)`` without gradient at an 8192-token prompt (``--issue-score-new-tokens`` completion
tokens, default 256); peak RSS rise and time, 2 threads, a real SnapKV-then-H2O rollout at 0.5 (the 8k score
rollout is synthetic, as above: sampling it would take longer than the measurement).

Times on the shared development CPUs are indicative: other jobs use the same cores. Compare ratios within one run.

Usage::

    python benchmarks/bench_long_context.py --quick             # seconds (minutes under load): does it still run?
    python benchmarks/bench_long_context.py --issue-table       # issue #28's table (~30 min on a loaded 2-core CPU)
    python benchmarks/bench_long_context.py --models tiny --lengths 1024 4096 8192 --in-process --json long.json
    python benchmarks/bench_long_context.py                     # the full grid: 1k-32k, tiny and 135m (hours)
    python benchmarks/bench_long_context.py --models 135m --sweeps prompt --modes dense smd --layouts shared_prefix
    python benchmarks/bench_long_context.py --models 135m --sweeps completion --lengths 1024 --modes dense smd --phases
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _common as C
import torch

from lit_smd.kv import NEVER, ShadowMask
from lit_smd.learner import learner_hidden_states, score
from lit_smd.losses import group_advantages, policy_loss, token_logprobs, token_logprobs_and_entropy
from lit_smd.losses.head import CPU_CHUNK_BYTES, logits_chunk_rows, output_head
from lit_smd.modules._grpo_smd import grpo_pass, smd_loss_and_kl
from lit_smd.rollout import Rollout, generate

MODES = ("dense", "naive", "smd")
LAYOUTS = ("shared_prefix", "per_row")
SWEEPS = ("prompt", "completion")
"""``prompt``: the prompt is ``length`` tokens, the completion ``--short``; ``completion``: the other way round."""

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"family": "qwen3", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": False},
    "135m": {"family": "llama", "hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3,
             "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True},
}  # fmt: skip
"""``tiny``: attention dominates (the issue's tiny Qwen3); ``135m``: the SmolLM2-135M shape, random init."""

QUICK = ["--models", "tiny", "--lengths", "64", "96", "--short", "16", "--num-samples", "2", "--window", "8",
         "--sinks", "2", "--calibration-lengths", "48", "24", "--slope-range", "64", "96", "--in-process"]  # fmt: skip
"""What ``--quick`` sets (before any other flag, so flags given with it still win)."""

GIB = 2**30


# ------------------------------------------------------------------------------------------------ synthetic rollout


@dataclass
class MaskPattern:
    """What the synthetic shadow mask imitates (see `synthetic_evict_steps`)."""

    budget: float = 0.5
    window: int = 32
    sinks: int = 4
    prompt_share: float = 0.125  # q: share of decode-phase evictions that take a surviving prompt key
    max_jitter: int = 1  # decode victims: window + 1 + d positions old, 0 <= d <= min(max_jitter, gap - 1)


def synthetic_evict_steps(
    num_layers: int, num_prompts: int, group: int, num_kv_heads: int, prompt_len: int, new_tokens: int,
    pattern: MaskPattern, seed: int = 0,
) -> torch.Tensor:
    """``[L, num_prompts * group, H_kv, P + N]`` int32 eviction steps shaped like a SnapKV-then-H2O rollout.

    * Prefill (SnapKV, once per prompt, so shared by the prompt's samples): ``P - floor(r P)`` random prompt keys
      outside the last ``window`` positions leave at ``e = P`` (seen by the prompt, by no completion token).
    * Decode (H2O, per sample): key ``i`` joins the cache at query ``i``; whenever the cache would hold more than
      ``floor(r (i + 1))`` keys, one leaves after query ``i`` attended (``e = i + 1``, as the rollout records it):
      with probability ``q`` a random surviving prompt key (sinks excepted), otherwise the decode key just leaving
      the recent window, ``window + 1 + d`` positions old (a prompt key while no decode key has left the window).

    Every key is evicted at most once and never returns; the mask follows `lit_smd.kv.ShadowMask`'s contract.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = num_prompts * group
    total = prompt_len + new_tokens
    shape = (num_layers, rows, num_kv_heads)
    steps = torch.full((*shape, total + 1), NEVER, dtype=torch.int32)  # the last column takes void evictions

    # Prefill: the same drops for the samples of one prompt.
    kept = math.floor(pattern.budget * prompt_len)
    candidates = max(prompt_len - pattern.window, prompt_len - kept)  # positions [0, candidates) may be dropped
    drops = prompt_len - kept
    if drops > 0:
        order = torch.rand(num_layers, num_prompts, num_kv_heads, candidates, generator=generator).argsort(-1)
        dropped = order[..., :drops].repeat_interleave(group, dim=1)  # [L, B, H, drops]
        steps.scatter_(-1, dropped, prompt_len)

    # Decode: eviction times from the budget, then one victim per eviction and (layer, row, head).
    queries = torch.arange(prompt_len, total)  # query i appends key i
    needed = (kept + queries - prompt_len + 1 - torch.floor(pattern.budget * (queries + 1)).long()).clamp(min=0)
    needed = torch.cummax(needed, 0).values
    times = queries[torch.diff(needed, prepend=torch.zeros(1, dtype=torch.long)) > 0] + 1  # [K]: after query i
    if times.numel() == 0:
        return steps[..., :total].contiguous()
    gaps = torch.diff(times, prepend=times[:1] - 1)
    jitter = (torch.rand(times.shape, generator=generator) * torch.clamp(gaps, max=pattern.max_jitter + 1)).long()
    decode_victim = times - pattern.window - 1 - jitter  # [K], strictly increasing
    wants_prompt = (torch.rand(*shape, times.numel(), generator=generator) < pattern.prompt_share) | (
        decode_victim < prompt_len
    )  # [L, B, H, K]
    # Surviving prompt keys (not dropped by the prefill, not a sink) in a random order, survivors first.
    survives = steps[..., :prompt_len] == NEVER
    survives[..., : pattern.sinks] = False
    priority = torch.rand(*shape, prompt_len, generator=generator).masked_fill(~survives, 2.0)
    prompt_order = priority.argsort(-1)  # [L, B, H, P]
    num_survivors = survives.sum(-1, keepdim=True)  # [L, B, H, 1]
    rank = wants_prompt.long().cumsum(-1) - 1  # [L, B, H, K]: which survivor a prompt eviction takes
    takes_prompt = wants_prompt & (rank < num_survivors)
    prompt_victim = prompt_order.gather(-1, rank.clamp(0, prompt_len - 1))
    decode_ok = decode_victim >= prompt_len
    victim = torch.where(takes_prompt, prompt_victim, torch.where(decode_ok, decode_victim, total))
    steps.scatter_(-1, victim, times.to(torch.int32).expand(*shape, -1))
    return steps[..., :total].contiguous()


def spread_lengths(length: int, count: int, shortest: float) -> list[int]:
    """``count`` lengths from ``length`` down to ``shortest`` times it, evenly (all ``length`` at 1)."""
    steps = max(count - 1, 1)
    return [max(1, round(length * (1 - (1 - shortest) * i / steps))) for i in range(count)]


def synthetic_rollout(
    model_cfg: dict[str, Any], prompt_len: int, new_tokens: int, num_prompts: int, group: int,
    pattern: MaskPattern | None, seed: int = 0, shortest: float = 1.0, shortest_completion: float = 1.0,
) -> Rollout:
    """A rollout of random tokens with a synthetic shadow mask unless ``pattern`` is None (a dense rollout): every
    prompt ``prompt_len`` tokens and every completion ``new_tokens`` (no EOS). With ``shortest < 1`` the prompts are
    `spread_lengths` long (left-padded to the longest, as a batch of prompts of different lengths is); with
    ``shortest_completion < 1`` so are each prompt's completions (right-padded, as samples that ended early are, their
    masks frozen at their end)."""
    if shortest < 1 or shortest_completion < 1:
        news = spread_lengths(new_tokens, group, shortest_completion)
        return Rollout.cat([  # the samples of one prompt share its seed: the same prompt and prefill drops
            synthetic_rollout(model_cfg, length, new, 1, 1, pattern, seed=seed + i)
            for i, length in enumerate(spread_lengths(prompt_len, num_prompts, shortest)) for new in news
        ])  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    vocab = model_cfg["vocab_size"]
    rows = num_prompts * group
    prompts = torch.randint(7, vocab, (num_prompts, prompt_len), generator=generator).repeat_interleave(group, 0)
    shadow = None
    if pattern is not None:
        shadow = ShadowMask(synthetic_evict_steps(
            model_cfg["num_layers"], num_prompts, group, model_cfg["num_kv_heads"], prompt_len, new_tokens, pattern,
            seed=seed,
        ))  # fmt: skip
    return Rollout(
        prompt_ids=prompts,
        prompt_mask=torch.ones(rows, prompt_len, dtype=torch.bool),
        completion_ids=torch.randint(7, vocab, (rows, new_tokens), generator=generator),
        completion_mask=torch.ones(rows, new_tokens, dtype=torch.bool),
        logprobs=torch.zeros(rows, new_tokens),
        finish_reason=["length"] * rows,
        shadow_mask=shadow,
    )


def visible_fraction(rollout: Rollout) -> float | None:
    mask = rollout.shadow_mask
    return None if mask is None else float(mask.visible_fraction(rollout.prompt_lengths, rollout.completion_mask))


def mask_statistics(rollout: Rollout, window: int) -> dict[str, float]:
    """How a rollout's shadow mask evicts: the figures `calibrate` compares between a real and a synthetic mask."""
    steps = rollout.shadow_mask.evict_steps.long()  # [L, B, H, T]
    prompt_len = int(rollout.prompt_lengths[0])
    keys = torch.arange(steps.shape[-1])
    evicted = steps < NEVER
    in_prompt = keys < prompt_len
    at_prefill = evicted & (steps <= prompt_len) & in_prompt
    decode_phase = evicted & ~at_prefill
    late = decode_phase & (steps > prompt_len + window + 1)
    lifetimes = (steps - keys)[decode_phase & ~in_prompt].double()
    phases = rollout.shadow_mask.visible_fraction_by_phase(rollout.prompt_lengths, rollout.completion_mask)
    return {
        "visible": visible_fraction(rollout),
        "visible_prompt": float(phases["prompt"]),
        "visible_decode": float(phases["decode"]),
        "prefill_dropped": float(at_prefill.sum() / (in_prompt.sum() * steps[..., 0].numel())),
        "prompt_share": float((decode_phase & in_prompt).sum() / decode_phase.sum().clamp(min=1)),
        # the same once decode keys have left the recent window (before, only prompt keys can go): q
        "prompt_share_late": float((late & in_prompt).sum() / late.sum().clamp(min=1)),
        "decode_evicted": float((decode_phase & ~in_prompt).sum() / ((~in_prompt).sum() * steps[..., 0].numel())),
        "lifetime_median": float(lifetimes.median()) if lifetimes.numel() else float("nan"),
        "lifetime_p90": float(lifetimes.quantile(0.9)) if lifetimes.numel() else float("nan"),
    }


def real_rollout(model, prompt_len: int, new_tokens: int, group: int, pattern: MaskPattern, seed: int = 0):
    """A real SnapKV-then-H2O rollout (`lit_smd.rollout.generate`) of one random prompt, exactly ``new_tokens``."""
    ids, mask = C.left_padded_prompts(model.config.vocab_size, [prompt_len], torch.device("cpu"), seed=seed)
    compressor = C.make_compressor("prefill_then_decode", pattern.budget, window=pattern.window, sinks=pattern.sinks)
    return generate(model, ids, mask, compressor=compressor, max_new_tokens=new_tokens, num_generations=group,
                    generator=torch.Generator().manual_seed(seed))  # fmt: skip


def calibrate(args: argparse.Namespace) -> tuple[MaskPattern, dict[str, Any]]:
    """Measure a real SnapKV-then-H2O rollout on the tiny model; return the pattern to synthesise and the figures."""
    pattern = MaskPattern(budget=args.budget, window=args.window, sinks=args.sinks)
    prompt_len, new_tokens = args.calibration_lengths
    model = build_model("tiny", torch.float32)
    real = mask_statistics(real_rollout(model, prompt_len, new_tokens, args.num_samples, pattern), args.window)
    if args.prompt_share is None:
        pattern.prompt_share = real["prompt_share_late"]
    else:
        pattern.prompt_share = args.prompt_share
    synthetic = mask_statistics(synthetic_rollout(
        model_config("tiny"), prompt_len, new_tokens, 1, args.num_samples, pattern
    ), args.window)  # fmt: skip
    return pattern, {"prompt_len": prompt_len, "new_tokens": new_tokens, "real": real, "synthetic": synthetic}


# ---------------------------------------------------------------------------------------------------- the step


def model_config(name: str) -> dict[str, Any]:
    return dict(MODELS[name])


def build_model(name: str, dtype: torch.dtype, max_positions: int = 4096, device: torch.device | None = None):
    """The seeded model ``name`` of `MODELS`, in train mode (the learner's), lit_smd's attention."""
    cfg = model_config(name)
    family = cfg.pop("family")
    tie = cfg.pop("tie_word_embeddings")
    config = C.model_config(max_position_embeddings=max(32768, max_positions), **cfg)
    model = C.build_model(family, {**config, "tie_word_embeddings": tie}, dtype, device or torch.device("cpu"))
    return model.train()


class PhaseClock:
    """Seconds per phase of learner steps (``--phases``): ``start()`` opens a step, ``mark(name)`` closes the phase
    that ran since the last mark as ``name`` (device synchronised). As a phase owner (``phase_listeners``, what
    `smd_loss_and_kl` reports its dense teacher to) it closes ``head`` when the teacher starts and ``teacher`` when it
    ends. ``steps``: one ``{phase: seconds}`` per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[dict[str, float]] = []
        self.phase_listeners = [self._heard]
        self._last = 0.0

    def start(self) -> None:
        C.synchronize(self.device)
        self.steps.append({})
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        C.synchronize(self.device)
        now = time.perf_counter()
        self.steps[-1][name] = self.steps[-1].get(name, 0.0) + now - self._last
        self._last = now

    def _heard(self, phase: str, starting: bool) -> None:
        self.mark("head" if starting else phase)


PHASES = ("pass", "head", "teacher", "kl", "backward")
"""The phases `grpo_learner_step` marks: the learner pass; the log-prob head and the policy loss (for smd also the
policy loss's gradient with respect to the log-probs); SMD's dense no-grad teacher; the KL's pass over the vocabulary
(the policy term's head gradient pushed with it); ``loss.backward()``."""


def grpo_learner_step(
    policy, rollout: Rollout, mode: str, layout: str, group: int, *, kl_coef: float, chunk_size: int,
    clock: PhaseClock | None = None,
) -> torch.Tensor:
    """Forward and backward of `GRPOModule.training_step`'s loss on one on-policy batch (defaults: ``grpo`` loss,
    epsilon 0.2, temperature 1, no reference); for ``smd`` the KL to the dense no-grad teacher is added. With a
    ``clock`` each of `PHASES` the step runs is timed."""
    mark = clock.mark if clock is not None else lambda name: None
    if clock is not None:
        clock.start()
    rewards = (torch.arange(len(rollout)) % 3 == 0).float()  # mixed 0/1 within each group
    advantages = group_advantages(rewards, group)
    smd = mode == "smd"
    teacher = smd and kl_coef > 0
    learner = grpo_pass(policy, rollout, layout, shadow=smd, keep_prompt_kv=teacher)
    mark("pass")
    head, ids = output_head(policy), rollout.completion_ids
    mask = rollout.completion_mask  # [B, N]: only the completion tokens reach the vocabulary
    if teacher:  # smd: the policy term's gradient reaches the head in the KL's pass, which gives the entropy
        with torch.no_grad():
            logprobs = token_logprobs(learner.hidden, head, ids, chunk_size=chunk_size, mask=mask).requires_grad_()
    else:
        logprobs = token_logprobs_and_entropy(learner.hidden, head, ids, chunk_size=chunk_size, mask=mask)[0]
    loss = policy_loss(logprobs, logprobs.detach(), advantages, rollout.completion_mask, loss_type="grpo").loss
    mark("head")
    if teacher:
        loss, _, _ = smd_loss_and_kl(policy, rollout, learner, rollout.completion_mask, loss, logprobs,
                                     kl_coef=kl_coef, temperature=1.0, chunk_size=chunk_size,
                                     phase_owner=clock)  # fmt: skip
        mark("kl")
    loss.backward()
    mark("backward")
    return loss.detach()


def issue_pass(policy, rollout: Rollout, layout: str, shadow: bool, chunk_size: int) -> None:
    """The issue's "one learner pass with gradient": the pass, the chunked log-prob head, backward of their sum."""
    hidden = learner_hidden_states(policy, rollout, shadow=shadow, layout=layout).hidden
    logprobs, _ = token_logprobs_and_entropy(hidden, output_head(policy), rollout.completion_ids, chunk_size=chunk_size)
    logprobs.masked_fill(~rollout.completion_mask, 0.0).sum().backward()


# ------------------------------------------------------------------------------------------------ memory probes


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MEMORY_MMAP_THRESHOLD = 64 * 1024
TIMING_MMAP_THRESHOLD = CPU_CHUNK_BYTES  # glibc's dynamic threshold at its 64-bit maximum (DEFAULT_MMAP_THRESHOLD_MAX)


def use_allocator(purpose: str) -> None:
    """Set glibc's allocator (CPU; a no-op elsewhere) for a ``"memory"`` or a ``"timing"`` step.

    ``"memory"``: blocks of 64 KiB and more get their own mappings and the heap's free pages are trimmed, so freed
    tensors leave the resident size and the high-water mark's rise is what the step itself held (one cell's peak does
    not hide in earlier free lists). ``"timing"``: blocks below 32 MiB reuse the heap, as in a training process under
    glibc's default (dynamic) threshold once it has grown; under the 64 KiB threshold every mid-size buffer costs an
    ``mmap``, page faults and an ``munmap``, which taxes code with many block-sized buffers (SMD's blocked attention:
    1.8x dense instead of 1.25x on the tiny model at 2k per row) with costs a training run does not pay.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if purpose == "memory":
        libc.mallopt(M_MMAP_THRESHOLD, MEMORY_MMAP_THRESHOLD)
        libc.malloc_trim(0)
    else:
        libc.mallopt(M_MMAP_THRESHOLD, TIMING_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * TIMING_MMAP_THRESHOLD)


def mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


class Probe:
    """Peak memory of a block above the memory before it: ``VmHWM`` on the CPU, the allocator's peak on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = C.reset_resident_peak()

    def rise(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return C.resident_rise(self.base)


def _zero_grad(model) -> None:
    for parameter in model.parameters():
        parameter.grad = None


# ------------------------------------------------------------------------------------------------------ worker


def _cell_setup(spec: dict[str, Any]) -> tuple[torch.device, Callable[..., Rollout], Callable[..., None]]:
    """A worker's device, seeded model and step from ``spec`` (`cell_spec`): ``make(mode)`` builds the cell's rollout
    for ``mode`` (dense: no shadow mask), ``step(mode, rollout, clock=None)`` runs one step of ``spec["kind"]`` (a
    GRPO step's phases timed on ``clock``) and clears the gradients."""
    device = torch.device(spec["device"])
    C.apply_threads(spec["threads"], device)
    model = build_model(spec["model"], C.DTYPES[spec["dtype"]], spec["prompt_len"] + spec["new_tokens"], device)
    if spec["gradient_checkpointing"]:  # what GRPOModule(gradient_checkpointing=True) enables
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    cfg, group, kind = model_config(spec["model"]), spec["num_samples"], spec["kind"]

    def make(mode: str, prompt_len: int = spec["prompt_len"], new_tokens: int = spec["new_tokens"]) -> Rollout:
        pattern = None if mode == "dense" else MaskPattern(**spec["pattern"])
        return synthetic_rollout(cfg, prompt_len, new_tokens, spec["num_prompts"], group, pattern,
                                 shortest=spec["shortest_prompt"],
                                 shortest_completion=spec["shortest_completion"]).to(device)  # fmt: skip

    def step(mode: str, rollout: Rollout, clock: PhaseClock | None = None) -> None:
        if kind == "grpo":
            grpo_learner_step(model, rollout, mode, spec["layout"], group, kl_coef=spec["kl_coef"],
                              chunk_size=spec["chunk_size"], clock=clock)  # fmt: skip
        elif kind == "pass":
            issue_pass(model, rollout, spec["layout"], mode == "smd", spec["chunk_size"])
        else:  # "score": score(model, rollout, shadow=...) without gradient
            with torch.no_grad():
                score(model, rollout, shadow=mode == "smd")
        _zero_grad(model)

    return device, make, step


def _warm_up(
    make: Callable[..., Rollout], step: Callable[[str, Rollout], None], mode: str, spec: dict[str, Any]
) -> None:
    """One small step: lazy initialisation outside the measurement."""
    step(mode, make(mode, min(spec["prompt_len"], 64), min(spec["new_tokens"], 16)))


def keeps_kernels_per_shape(spec: dict[str, Any]) -> bool:
    """Whether the cell's attention kernel keeps memory per shape it has run: torch's CPU flash attention in bfloat16
    (on CPUs with AMX it JIT-compiles a oneDNN BRGEMM kernel per key-length tail and keeps it with its scratch
    buffers: measured ~1.6 MiB per tail in the backward, ~0.65 GiB once every tail of 512 has run)."""
    return spec["device"] == "cpu" and spec["dtype"] == "bfloat16"


def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell's mode's peak, in this (fresh) process: build, warm up, one step. ``spec`` is what `cell_spec`
    makes.

    Where the kernels keep memory per shape (`keeps_kernels_per_shape`) the warm-up also runs the measured step once:
    what the kernels keep is paid once per process and shape, not per step (a training process that has run a few
    steps holds it whatever the step), so the measured step is a second run of the same shapes; ``kept_bytes`` is
    what the process kept from that full-size warm-up (resident after it, collected, minus before it)."""
    device, make, step = _cell_setup(spec)
    mode = spec["mode"]
    _warm_up(make, step, mode, spec)
    if spec.get("rollout_path"):  # the issue table's passes: a real rollout, sampled once by the parent
        rollout = torch.load(spec["rollout_path"], weights_only=False).to(device)
    else:
        rollout = make(mode)
    visible = visible_fraction(rollout)
    probe = Probe(device)
    if spec["set_allocator"]:
        use_allocator("memory")  # freed blocks leave the resident size
    kept = None
    if keeps_kernels_per_shape(spec):
        before = C.proc_status_kib("VmRSS") * 1024
        step(mode, rollout)
        gc.collect()
        kept = C.proc_status_kib("VmRSS") * 1024 - before
    probe.start()
    base = probe.base
    step(mode, rollout)
    # base: resident (CPU) or allocated (CUDA) before the step
    return {"peak_bytes": probe.rise(), "visible": visible, "base_bytes": base, "kept_bytes": kept}


def time_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """The time of every mode of ``spec["modes"]`` in this one (fresh) process, in turns: each of ``spec["repeats"]``
    repeats runs every mode once (the order reversed every other repeat), so that each mode's step ``i`` ran beside
    dense's step ``i`` in the same process under the same load; before them, a small step and one full-size step per
    mode, untimed. Returns ``{"times_s": {mode: [seconds, ...]}}``, with
    ``spec["phases"]`` also ``"phases_s": {mode: [{phase: seconds}, ...]}`` (`PhaseClock`), one per timed step."""
    device, make, step = _cell_setup(spec)
    modes, path = spec["modes"], spec.get("rollout_path")  # the issue table: one real rollout, two views
    rollouts = {mode: torch.load(path, weights_only=False).to(device) if path else make(mode) for mode in modes}
    for mode in modes:
        _warm_up(make, step, mode, spec)
    if spec["set_allocator"]:
        use_allocator("timing")
    # One untimed step per mode at full size: the heap's first growth to a step's size (page faults a training process
    # pays once) would otherwise land on whichever mode runs first (the 135M shape's first dense step: 33 s, then
    # 11-13 s), and a reduced-precision CPU kernel's compilations per shape (`keeps_kernels_per_shape`) on each
    # mode's first step (SMD's blocks have more shapes than dense's).
    for mode in modes:
        step(mode, rollouts[mode])
    clocks = {mode: PhaseClock(device) if spec.get("phases") else None for mode in modes}
    steps = {mode: functools.partial(step, mode, rollouts[mode], clocks[mode]) for mode in modes}
    timed = C.time_interleaved(steps, device, repeats=spec["repeats"], warmup=0, alternate=True)
    result: dict[str, Any] = {"times_s": {mode: timed[mode]["times_s"] for mode in modes}}
    if spec.get("phases"):
        result["phases_s"] = {mode: clocks[mode].steps for mode in modes}
    return result


# ------------------------------------------------------------------------------------------------------ parent


def run_worker(spec: dict[str, Any], limit_bytes: int, max_seconds: float) -> dict[str, Any]:
    """Run one cell in a fresh subprocess, killing it past ``limit_bytes`` resident or ``max_seconds`` of wall.

    With ``spec["in_process"]`` (``--in-process``, what ``--quick`` uses) the cell runs here instead, unguarded: no
    import per cell, but the peaks then depend on what earlier cells left in the allocator.
    """
    if spec.get("in_process"):
        return {"status": "ok", **(time_cell(spec) if "modes" in spec else run_cell(spec))}
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    verdict: dict[str, Any] = {}

    def watch() -> None:
        start = time.perf_counter()
        while proc.poll() is None:
            try:
                rss = C.proc_status_kib("VmRSS", proc.pid) * 1024
            except (OSError, RuntimeError):
                rss = 0
            verdict["max_rss_seen"] = max(verdict.get("max_rss_seen", 0), rss)
            if rss > limit_bytes:
                verdict["status"] = f"killed: RSS passed {limit_bytes / GIB:.1f} GiB"
                proc.kill()
                return
            if time.perf_counter() - start > max_seconds:
                verdict["status"] = f"killed: over {max_seconds:g} s"
                proc.kill()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate()
    watcher.join()
    if "status" in verdict:
        return {"status": verdict["status"]}
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or ["?"])[-1]
        return {"status": f"failed (exit {proc.returncode}): {last[:200]}"}
    return {"status": "ok", **json.loads(stdout.strip().splitlines()[-1])}


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(value) against log(length); None with fewer than two lengths."""
    points = [(x, y) for x, y in points if y and y > 0]
    if len({x for x, _ in points}) < 2:
        return None
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def predict_peak(history: list[dict[str, Any]], length: int) -> int | None:
    """Predicted peak (rise plus the worker's resident base) at ``length`` from the same series' measured cells."""
    done = [(r["length"], r["peak_bytes"], r["base_bytes"]) for r in history if r["status"] == "ok"]
    if not done:
        return None
    if len(done) >= 2:
        (x0, y0, _), (x1, y1, _) = done[-2], done[-1]
        exponent = max(1.0, math.log(max(y1, 1) / max(y0, 1)) / math.log(x1 / x0)) if x1 != x0 else 2.0
    else:
        exponent = 2.0
    x1, y1, base = done[-1]
    return int(base + max(y1, 1) * (length / x1) ** exponent)


def kept_note(results: list[dict[str, Any]]) -> str:
    """The header's sentence on what the full-size warm-up kept (`run_cell`), or "" when no cell ran one."""
    kept: dict[str, list[float]] = {}
    for row in results:
        if row.get("kept_bytes") is not None:
            kept.setdefault(row["mode"], []).append(row["kept_bytes"] / 2**20)
    if not kept:
        return ""
    spans = ", ".join(f"{mode} {min(v):.0f}-{max(v):.0f} MiB" for mode, v in kept.items())
    return (
        " bfloat16 on the CPU: torch's flash attention keeps a compiled kernel per key-length tail, once per process, "
        f"so each peak is the second run of its step's shapes; the first run kept {spans} in the process."
    )


def logits_chunk(args: argparse.Namespace, model: str) -> int:
    """``--chunk-size``, or the modules' default for the model's vocabulary and ``--dtype`` on ``--device``
    (`lit_smd.losses.head.logits_chunk_rows`: 1024 rows on CUDA; on the CPU the most rows whose float32 buffer stays
    within glibc's 32 MiB heap threshold, as a larger one is mapped and page-faulted anew at every chunk, which on this
    benchmark's virtual machine cost 0.1-0.2 s per 192 MiB buffer and put the 135M shape's head and KL at 7-13 s per
    step for 2-4 s of work)."""
    return logits_chunk_rows(args.chunk_size, MODELS[model]["vocab_size"], args.device, getattr(torch, args.dtype))


def cell_spec(args: argparse.Namespace, model: str, mode: str, layout: str, prompt_len: int, new_tokens: int,
              pattern: MaskPattern, kind: str = "grpo", **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "model": model, "mode": mode, "layout": layout, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "num_prompts": args.num_prompts, "shortest_prompt": args.shortest_prompt, "num_samples": args.num_samples,
        "shortest_completion": args.shortest_completion, "kl_coef": args.kl_coef,
        "chunk_size": logits_chunk(args, model), "dtype": args.dtype, "device": args.device, "threads": args.threads,
        "repeats": args.repeats, "pattern": vars(pattern), "kind": kind, "in_process": args.in_process,
        "gradient_checkpointing": args.gradient_checkpointing,
        "set_allocator": not args.quick,  # (not in a smoke run, which may share its process with tests)
        "phases": args.phases,
        **extra,
    }  # fmt: skip


def memory_limit(args: argparse.Namespace) -> int:
    """Bytes a worker may reach: ``--memory-limit-gib``, capped by what the machine has free now, minus a margin."""
    free = mem_available() - int(args.memory_margin_gib * GIB)
    return min(int(args.memory_limit_gib * GIB), free) if args.memory_limit_gib else free


def run_or_skip(args: argparse.Namespace, history: list[dict[str, Any]], length: int, spec: dict[str, Any]):
    """One worker of a cell, or its skip: when the series stopped at a shorter length, or when the peak predicted from
    ``history`` (the series' rows so far) would pass the memory limit. The result names both figures."""
    limit = memory_limit(args)
    predicted = predict_peak(history, length)
    stopped = next((r for r in history if r["status"] != "ok"), None)
    if stopped is not None:
        result = {"status": f"skipped: series stopped at {stopped['length']} ({stopped['status'].split(':')[0]})"}
    elif predicted is not None and predicted > limit:
        result = {"status": f"skipped: predicted {predicted / GIB:.1f} GiB > {limit / GIB:.1f}"}
    else:
        result = run_worker(spec, limit, args.max_seconds)
    return {**result, "predicted_bytes": predicted, "limit_bytes": limit}


def with_times(
    row: dict[str, Any], times: list[float], dense_times: list[float] | None, failed: str | None = None
) -> dict[str, Any]:
    """A mode's memory-worker result with its timed steps (``times_s``), their median and, beside dense's steps
    (``dense_times``, the same count, step ``i`` beside step ``i``), the per-pair time ratios (``pair_ratios``);
    ``failed``: the status of a timing worker that failed (``time_status``)."""
    row = {**row, "times_s": times, "median_s": statistics.median(times) if times else None}
    if failed is not None and row["status"] == "ok":
        row["time_status"] = failed
    if times and dense_times is not None:
        row["pair_ratios"] = [mine / theirs for mine, theirs in zip(times, dense_times, strict=True)]
    return row


def time_modes(
    args: argparse.Namespace, spec: dict[str, Any], modes: list[str], label: str
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]], str | None]:
    """``--rounds`` timing workers (`time_cell`) for ``modes`` of the cell ``spec``: every mode's step times, their
    phases (with ``spec["phases"]``; else empty lists), and the status of the first worker that failed (None when all
    ran)."""
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    phases: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for turn in range(args.rounds if modes else 0):
        result = run_worker({**spec, "modes": modes}, memory_limit(args), args.max_seconds)
        if result["status"] != "ok":
            return times, phases, result["status"]
        for mode in modes:
            times[mode] += result["times_s"][mode]
            phases[mode] += result.get("phases_s", {}).get(mode, [])
        print(f"  {label} times (worker {turn + 1}/{args.rounds}): "
              + ", ".join(f"{m} {statistics.median(t):.3g} s" for m, t in result["times_s"].items()),
              file=sys.stderr, flush=True)  # fmt: skip
    return times, phases, None


def dense_times(times: dict[str, list[float]], mode: str) -> list[float] | None:
    """The dense steps ``mode``'s steps are paired with (None for dense itself, or when dense was not timed)."""
    return None if mode == "dense" else times.get("dense")


def run_grid(args: argparse.Namespace, pattern: MaskPattern, payload: dict[str, Any]) -> None:
    """Every cell of the grid. Per length and layout: each mode's peak in a worker of its own (one step), then the
    time of all modes whose peak was measured in ``--rounds`` workers, each running the modes in turns
    (`time_cell`): every timed step of a mode has one of dense beside it, in the same process and under the same
    load, and the time ratio is the median of those pairs."""
    for model in args.models:
        for sweep in args.sweeps:
            series: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for length in args.lengths:
                prompt_len, new_tokens = (length, args.short) if sweep == "prompt" else (args.short, length)
                for layout in args.layouts:
                    rows = {}
                    for mode in args.modes:
                        spec = cell_spec(args, model, mode, layout, prompt_len, new_tokens, pattern)
                        rows[mode] = run_or_skip(args, series.setdefault((mode, layout), []), length, spec)
                        print(f"  {model} {sweep} {length} {layout} {mode} peak: {_cell(rows[mode], what='memory')}",
                              file=sys.stderr, flush=True)  # fmt: skip
                    timed = [mode for mode in args.modes if rows[mode]["status"] == "ok"]
                    spec = cell_spec(args, model, "dense", layout, prompt_len, new_tokens, pattern)
                    times, phases, failed = time_modes(args, spec, timed, f"{model} {sweep} {length} {layout}")
                    for mode in args.modes:
                        timed_row = with_times(rows[mode], times.get(mode, []), dense_times(times, mode), failed)
                        if phases.get(mode):
                            timed_row["phases_s"] = phases[mode]
                        row = {"model": model, "sweep": sweep, "length": length, "prompt_len": prompt_len,
                               "new_tokens": new_tokens, "mode": mode, "layout": layout, **timed_row}  # fmt: skip
                        series[(mode, layout)].append(row)
                        payload["results"].append(row)
                    C.write_json(args.json, payload)


# ------------------------------------------------------------------------------------------------------ tables


def _cell(row: dict[str, Any] | None, dense: dict[str, Any] | None = None, what: str = "both") -> str:
    if row is None:
        return "n/a"
    if row["status"] != "ok":
        return row["status"]
    memory = f"{row['peak_bytes'] / 2**20:.0f} MiB"
    seconds = row.get("time_status", "not timed") if row.get("median_s") is None else f"{row['median_s']:.3g} s"
    if dense is not None and dense.get("status") == "ok" and dense is not row:
        if dense["peak_bytes"] >= 2**20:  # below a MiB the RSS rise is page noise
            memory += f" ({row['peak_bytes'] / dense['peak_bytes']:.2f}x)"
        ratios = sorted(row.get("pair_ratios", []))
        if len(ratios) > 1:  # each step's ratio to the dense step beside it: median, range
            seconds += f" ({statistics.median(ratios):.2f}x; pairs {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
        elif row.get("median_s") is not None and dense.get("median_s"):
            seconds += f" ({row['median_s'] / dense['median_s']:.2f}x)"
    return {"memory": memory, "time": seconds, "both": f"{memory}, {seconds}"}[what]


def grid_tables(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    index = {(r["model"], r["sweep"], r["length"], r["layout"], r["mode"]): r for r in results}
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        for sweep in dict.fromkeys(r["sweep"] for r in results if r["model"] == model):
            fixed = "completion" if sweep == "prompt" else "prompt"
            spread = "".join(
                f" ({what}s from the {'swept' if sweep == what else what} length down to {fraction:g} of it, "
                f"{side}-padded)"
                for what, fraction, side in (("prompt", args.shortest_prompt, "left"),
                                             ("completion", args.shortest_completion, "right"))
                if fraction < 1
            )  # fmt: skip
            spec = MODELS[model]
            out.append(
                f"### {model} ({spec['family']}, {spec['num_layers']} layers, hidden {spec['hidden_size']}, "
                f"{spec['num_heads']}/{spec['num_kv_heads']} heads, vocab {spec['vocab_size']}): {sweep} length, "
                f"{fixed} {args.short} tokens, {args.num_prompts} prompt(s) x {args.num_samples} samples"
                f"{spread}, logits in chunks of {logits_chunk(args, model)} rows\n"
            )
            headers = ["length", "layout", "mask visible"] + [f"{mode} peak" for mode in args.modes] + [
                f"{mode} time" for mode in args.modes]  # fmt: skip
            lines = []
            for length in dict.fromkeys(r["length"] for r in results if (r["model"], r["sweep"]) == (model, sweep)):
                for layout in args.layouts:
                    cells = {mode: index.get((model, sweep, length, layout, mode)) for mode in args.modes}
                    if not any(cells.values()):
                        continue
                    dense = cells.get("dense")
                    visible = next((c["visible"] for c in cells.values() if c and c.get("visible") is not None), None)
                    lines.append([length, layout, C.fmt(visible, ".3f")]
                                 + [_cell(cells[m], dense, "memory") for m in args.modes]
                                 + [_cell(cells[m], dense, "time") for m in args.modes])  # fmt: skip
            out.append(C.markdown_table(headers, lines))
            out.append("")
    low, high = args.slope_range
    lines = []
    for model in dict.fromkeys(r["model"] for r in results):
        for sweep in dict.fromkeys(r["sweep"] for r in results if r["model"] == model):
            for layout in args.layouts:
                for mode in args.modes:
                    points = [(r["length"], r["peak_bytes"]) for r in results
                              if (r["model"], r["sweep"], r["layout"], r["mode"]) == (model, sweep, layout, mode)
                              and r["status"] == "ok" and low <= r["length"] <= high]  # fmt: skip
                    value = slope(points)
                    lengths = ", ".join(str(x) for x, _ in points) or "none"
                    lines.append([model, sweep, layout, mode, C.fmt(value, ".2f"), lengths])
    out.append(f"### Memory against length: log-log slope of the peak over {low}..{high} (1 = linear)\n")
    out.append(C.markdown_table(["model", "sweep", "layout", "mode", "slope", "lengths used"], lines))
    if args.phases:
        out += ["", phase_table(results, index)]
    return "\n".join(out)


def phase_table(results: list[dict[str, Any]], index: dict[tuple, dict[str, Any]]) -> str:
    """``--phases``: each mode's median seconds per phase of the step (`PHASES`), and that over the median dense step
    of the same cell."""
    lines = []
    for row in results:
        if not row.get("phases_s"):
            continue
        dense = index.get((row["model"], row["sweep"], row["length"], row["layout"], "dense"))
        base = dense.get("median_s") if dense else None
        cells = []
        for phase in (*PHASES, None):
            seconds = [sum(step.values()) if phase is None else step.get(phase) for step in row["phases_s"]]
            seconds = [value for value in seconds if value is not None]
            if not seconds:
                cells.append("")
                continue
            median = statistics.median(seconds)
            cells.append(f"{median:.3g} s" + (f" ({median / base:.2f})" if base else ""))
        lines.append([row["model"], row["sweep"], row["length"], row["layout"], row["mode"], *cells])
    return (
        "### Where the step's time goes (--phases): median seconds per phase (over the median dense step of the "
        "cell)\n\n" + C.markdown_table(["model", "sweep", "length", "layout", "mode", *PHASES, "sum"], lines)
    )


def calibration_text(calibration: dict[str, Any], pattern: MaskPattern) -> str:
    real, synthetic = calibration["real"], calibration["synthetic"]
    names = [("visible", "visible fraction (completion tokens)"), ("visible_prompt", "prompt keys kept by prefill"),
             ("visible_decode", "visible fraction, decode tokens"), ("prompt_share", "decode evictions of prompt keys"),
             ("prompt_share_late", "the same, after the first window + 1 decode steps (q)"),
             ("decode_evicted", "decode keys evicted"), ("lifetime_median", "evicted decode key lifetime, median"),
             ("lifetime_p90", "evicted decode key lifetime, p90")]  # fmt: skip
    rows = [[label, C.fmt(real[key], ".3g"), C.fmt(synthetic[key], ".3g")] for key, label in names]
    return (
        f"**Shadow masks are synthetic** (SnapKV-then-H2O-like, budget {pattern.budget}, window {pattern.window}, "
        f"sinks {pattern.sinks}, prompt-key share q = {pattern.prompt_share:.3f}), calibrated against a real "
        f"SnapKV-then-H2O rollout of the tiny model at prompt {calibration['prompt_len']}, "
        f"{calibration['new_tokens']} new tokens:\n\n"
        + C.markdown_table(["", "real rollout", "synthetic mask"], rows)
    )


# ------------------------------------------------------------------------------------------------ issue table


def issue_rows(args: argparse.Namespace, spec: dict[str, Any], labels: dict[str, Any]) -> list[dict[str, Any]]:
    """The dense and the shadow view of one path of the issue table: each view's peak in a worker of its own, their
    times side by side (`time_modes`)."""
    rows = {}
    for mode in ("dense", "smd"):
        rows[mode] = run_worker({**spec, "mode": mode}, memory_limit(args), args.max_seconds)
    label = f"issue: {labels['kind']} {labels['layout']} {labels['new_tokens']}"
    times, _, failed = time_modes(args, spec, [mode for mode in rows if rows[mode]["status"] == "ok"], label)
    out = [{**labels, "view": "shadow" if mode == "smd" else "dense",
            **with_times(row, times.get(mode, []), dense_times(times, mode), failed)} for mode, row in rows.items()]
    for row in out:
        print(f"  {label} {row['view']}: {_cell(row)}", file=sys.stderr, flush=True)
    return out


def run_issue_table(args: argparse.Namespace, payload: dict[str, Any]) -> str:
    """Issue #28's table: one learner pass with gradient per layout and view, and ``score`` without gradient."""
    pattern = MaskPattern(budget=args.budget, window=args.window, sinks=args.sinks)
    rows = []
    folder = tempfile.mkdtemp(prefix="bench_long_context_")
    policy = build_model("tiny", C.DTYPES[args.dtype])  # the workers build the same seeded weights
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # sampling: one thread (much faster on a loaded CPU); the workers use --threads
    for new_tokens in args.issue_new_tokens:
        start = time.perf_counter()
        rollout = real_rollout(policy, args.issue_prompt_len, new_tokens, args.num_samples, pattern)
        path = os.path.join(folder, f"rollout_{new_tokens}.pt")
        torch.save(rollout, path)
        payload.setdefault("rollouts", {})[new_tokens] = {
            "sample_s": time.perf_counter() - start, "visible": visible_fraction(rollout)}
        print(f"  issue: sampled the {new_tokens}-token rollout in {time.perf_counter() - start:.1f} s, visible "
              f"fraction {visible_fraction(rollout):.3f}", file=sys.stderr, flush=True)  # fmt: skip
    torch.set_num_threads(threads)
    for new_tokens in args.issue_new_tokens:
        path = os.path.join(folder, f"rollout_{new_tokens}.pt")
        for layout in LAYOUTS:  # the dense view / the shadow view of the same compressed rollout
            spec = cell_spec(args, "tiny", "dense", layout, args.issue_prompt_len, new_tokens, pattern, kind="pass",
                             rollout_path=path)  # fmt: skip
            rows += issue_rows(args, spec, {"kind": "pass", "layout": layout, "new_tokens": new_tokens})
            payload["results"] = rows
            C.write_json(args.json, payload)
    spec = cell_spec(args, "tiny", "dense", "per_row", args.issue_score_prompt_len, args.issue_score_new_tokens,
                     pattern, kind="score")  # fmt: skip
    rows += issue_rows(args, spec, {"kind": "score", "layout": "per_row", "new_tokens": args.issue_score_new_tokens})
    payload["results"] = rows
    C.write_json(args.json, payload)
    shutil.rmtree(folder, ignore_errors=True)

    def find(kind: str, layout: str, view: str, new: int) -> dict[str, Any] | None:
        return next((r for r in rows if (r["kind"], r["layout"], r["view"], r["new_tokens"]) == (kind, layout, view,
                                                                                                  new)), None)

    headers = ["path"] + [f"{n} completion tokens" for n in args.issue_new_tokens]
    lines = []
    for layout, label in (("shared_prefix", "shared prefix (GRPO default)"), ("per_row", "per row")):
        for view in ("dense", "shadow"):
            cells = []
            for new in args.issue_new_tokens:
                row, dense = find("pass", layout, view, new), find("pass", layout, "dense", new)
                cells.append(_cell(row, dense if view == "shadow" else None))
            lines.append([f"{label}, {view} view" + (" (SMD)" if view == "shadow" else "")] + cells)
    score_dense = find("score", "per_row", "dense", args.issue_score_new_tokens)
    score_shadow = find("score", "per_row", "shadow", args.issue_score_new_tokens)
    lines.append([f"`score(model, rollout, shadow=True)` without gradient, {args.issue_score_prompt_len}-token prompt, "
                  f"{args.issue_score_new_tokens} new tokens (synthetic mask)",
                  f"shadow {_cell(score_shadow, score_dense)} vs dense {_cell(score_dense)}"]
                 + [""] * (len(args.issue_new_tokens) - 1))  # fmt: skip
    return C.markdown_table(headers, lines)


# -------------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default; RSS peaks) or cuda (allocator peaks)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--sweeps", nargs="+", choices=SWEEPS, default=list(SWEEPS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768],
                        help="the swept length (prompt or completion tokens)")
    parser.add_argument("--short", type=int, default=256, help="the other length: completion of the prompt sweep, "
                        "prompt of the completion sweep")  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--shortest-prompt", type=float, default=1.0, metavar="FRACTION",
                        help="prompts of different lengths: from the prompt length down to FRACTION of it over "
                        "--num-prompts (>= 2) prompts, left-padded (default 1: all the same length)")
    parser.add_argument("--shortest-completion", type=float, default=1.0, metavar="FRACTION",
                        help="completions of different lengths (samples that ended early): from the completion length "
                        "down to FRACTION of it over each prompt's samples, right-padded (default 1: all full)")
    parser.add_argument("--num-samples", type=int, default=2, help="completions per prompt (the GRPO group)")
    parser.add_argument("--kl-coef", type=float, default=0.1, help="SMD's lambda")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="logits_chunk_size of the head and the KL (default: the modules' default, 1024 on CUDA; "
                        f"on the CPU the most rows whose float32 [rows, vocab] buffer stays under "
                        f"{CPU_CHUNK_BYTES // 2**20} MiB, at most 1024)")
    parser.add_argument("--dtype", choices=list(C.DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per mode in each timing worker (the modes "
                        "taking turns)")
    parser.add_argument("--rounds", type=int, default=1, help="timing workers per cell (the grid)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="wall limit of one cell's worker")
    parser.add_argument("--memory-limit-gib", type=float, default=None,
                        help="a worker's resident limit (default: MemAvailable minus the margin, read per cell)")
    parser.add_argument("--memory-margin-gib", type=float, default=1.5,
                        help="kept free for the rest of the machine")
    parser.add_argument("--slope-range", type=int, nargs=2, default=[4096, 32768], metavar=("LOW", "HIGH"))
    parser.add_argument("--budget", type=float, default=0.5, help="kept KV fraction the synthetic mask imitates")
    parser.add_argument("--window", type=int, default=32, help="SnapKV observation / H2O recent window")
    parser.add_argument("--sinks", type=int, default=4, help="H2O attention sinks")
    parser.add_argument("--prompt-share", type=float, default=None,
                        help="q, share of decode evictions taking a prompt key (default: calibrated)")
    parser.add_argument("--calibration-lengths", type=int, nargs=2, default=[256, 256], metavar=("PROMPT", "NEW"),
                        help="the real rollout the synthetic mask is calibrated on")
    parser.add_argument("--quick", action="store_true",
                        help="seconds-long smoke run (tiny model, tiny lengths, --in-process): measures nothing")
    parser.add_argument("--in-process", action="store_true",
                        help="run every cell in this process: no import per cell (minutes each on a loaded CPU), but "
                        "no memory guard, and a cell's peak may hide in memory an earlier cell left")
    parser.add_argument("--issue-table", action="store_true", help="reproduce issue #28's table instead of the grid")
    parser.add_argument("--issue-prompt-len", type=int, default=256)
    parser.add_argument("--issue-new-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--issue-score-prompt-len", type=int, default=8192)
    parser.add_argument("--issue-score-new-tokens", type=int, default=256)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    C.add_output_flags(parser)
    parser.add_argument("--phases", action="store_true",
                        help="also time each phase of the step (device synchronised at each phase's end)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="activation checkpointing per decoder layer, as GRPOModule(gradient_checkpointing=True)")
    C.add_threads_flag(parser, default=None)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        spec = json.loads(args.worker)
        print(json.dumps(time_cell(spec) if "modes" in spec else run_cell(spec)))
        return {}
    if args.quick:
        args = build_parser().parse_args(QUICK + argv)
        if args.issue_table:
            args = build_parser().parse_args(QUICK + ["--issue-new-tokens", "48", "--issue-prompt-len", "32",
                                                      "--issue-score-prompt-len", "128",
                                                      "--issue-score-new-tokens", "16"] + argv)  # fmt: skip
    if args.threads is None:  # the issue's table was measured with 2 threads; the grid uses the benchmarks' 1
        args.threads = 2 if args.issue_table else 1
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit(f"--rounds and --repeats must be >= 1, got {args.rounds} and {args.repeats}")
    if args.phases and args.issue_table:
        raise SystemExit("--phases times the phases of the grid's GRPO steps; --issue-table times single passes")
    if args.num_samples < 2:
        raise SystemExit(f"--num-samples must be >= 2 (a GRPO group), got {args.num_samples}")
    if not 0 < args.shortest_prompt <= 1 or (args.shortest_prompt < 1 and args.num_prompts < 2):
        raise SystemExit(f"--shortest-prompt must be in (0, 1], and below 1 needs --num-prompts >= 2; got "
                         f"{args.shortest_prompt} with --num-prompts {args.num_prompts}")  # fmt: skip
    if not 0 < args.shortest_completion <= 1:
        raise SystemExit(f"--shortest-completion must be in (0, 1], got {args.shortest_completion}")
    device = C.resolve_device(args.device)
    C.apply_threads(args.threads, device)  # what the workers use; the environment below records it
    env = C.environment(device)
    payload: dict[str, Any] = {"benchmark": "long_context", "environment": env, "config": vars(args), "results": []}
    title = "# Long context: " + ("issue #28's table" if args.issue_table else "the GRPO learner step over length")
    where = "fresh subprocesses (one per mode for the peak, one per timing worker for the modes' times)"
    if args.in_process:
        where = "every cell in this process" + ("" if args.quick else " (--in-process)")
    print(f"{title}\n\n{C.describe(env)}; {where}\n", flush=True)
    try:
        if args.issue_table:
            text = (
                f"One learner pass with gradient (the pass, the chunked log-prob head, backward of the summed "
                f"log-probs) over a real SnapKV-then-H2O {args.budget} rollout: tiny Qwen3 (2 layers, hidden 64, "
                f"4/2 heads, vocab 256), {args.issue_prompt_len}-token prompt x {args.num_samples} samples; and "
                f"score() without gradient. Peak RSS rise of the pass (VmHWM), {where}; time of the pass: median "
                f"of {args.repeats * args.rounds} per view, the two views in turns in {args.rounds} timing "
                f"worker(s), {args.threads} torch thread(s). Ratios: shadow view against the dense view of the same "
                "path, same run (time: the median of each pass's ratio to the dense pass beside it). Times "
                "indicative: the CPU is shared.\n\n"
                + run_issue_table(args, payload)
            )
        else:
            pattern, calibration = calibrate(args)
            payload["calibration"] = calibration
            print(calibration_text(calibration, pattern) + "\n", file=sys.stderr, flush=True)
            run_grid(args, pattern, payload)
            text = (
                calibration_text(calibration, pattern) + "\n\n"
                f"GRPO learner step (forward + backward; smd adds the dense no-grad teacher and the KL, kl_coef "
                f"{args.kl_coef}), {args.dtype}, {args.threads} torch thread(s)"
                f"{', activation checkpointing per layer' if args.gradient_checkpointing else ''}. "
                f"Peak = resident high-water mark rise of one step (glibc mmap threshold 64 KiB), {where}; time = "
                f"median of {args.repeats * args.rounds} step(s) per mode ({args.repeats} in each of {args.rounds} "
                f"timing worker(s), one per cell, the modes taking turns; threshold {TIMING_MMAP_THRESHOLD // 2**20} "
                f"MiB, as a training process has it). (x) = against dense of the same length and layout, same run; "
                f"for time the median (and range) of the ratios of each step to the dense step beside it. Times on a "
                f"shared CPU are indicative.{kept_note(payload['results'])}\n\n"
                + grid_tables(payload["results"], args)
            )
    except KeyboardInterrupt:
        C.interrupted(payload, args.json)
        text = grid_tables(payload["results"], args) if payload["results"] and not args.issue_table else ""
    print(text)
    C.write_markdown(args.markdown, f"{title}\n\n{C.describe(env)}; {where}\n\n{text}")
    return payload


if __name__ == "__main__":
    main()
