"""The learner: teacher-forced passes over a `Rollout`, from its tokens to their hidden states and log-probs.

Everything that trains on a rollout (GRPO's policy, reference and SMD teacher; distillation's student and teacher;
the teacher-logit cache) scores it here, in one of two layouts:

* ``"per_row"``: each sample is one right-padded row ``[prompt | completion | pads]`` whose column index is the
  logical position (`lit_smd.kv.shadow`), masked by a `lit_smd.kv.shadow.AttentionPlan`: causal and padding, plus
  the rollout's shadow mask in the shadow view.
* ``"shared_prefix"`` (default; the Prefix Grouper idea, arXiv 2506.05433, with our shadow-mask replay): consecutive
  rows with the same prompt form a group and each group becomes one packed row ``[prompt | c_1 | ... | c_G]``
  (`lit_smd.kv.packed.PackedPlan`): the prompt is encoded once, with gradient, and each completion attends to it and
  to its own earlier tokens. Log-probs and gradients equal the per-row pass's up to float reduction order; the
  prompt work drops from ``G`` encodings to one. A row is packed only when its prompt's hidden states are those of
  the dense view, i.e. in the shadow view no key of its prompt was evicted before the prompt ended (``e[j] >= P``
  for every prompt key ``j``; SnapKV-style prefill drops are recorded as ``e = P`` and qualify); other rows take the
  per-row pass. Groups are found from the data (equal prompts in consecutive rows), so minibatches that split a
  group, groups of one and prompts that differ within a nominal group all work.

The passes run the decoder only (``model.get_decoder()``) and keep the final hidden states predicting each
completion token (``[B, N, H]``), so losses project to the vocabulary in chunks (`lit_smd.losses`). `score` is the
unchunked projection to log-probs. SMD's dense teacher, `dense_hidden_states`, reuses a shadow-view pass: the prompt
keys and values of its rows whose prompt no eviction touched before the prompt ended (kept, detached, with
``keep_prompt_kv=True``; packed rows, or every such row in the per-row layout) serve the dense view unchanged, so only
the completion tokens run again, densely and without gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_smd.kv.attention import ensure_attention
from lit_smd.kv.flex import Backend, check_backend, use_flex
from lit_smd.kv.packed import PackedPlan
from lit_smd.kv.shadow import NEVER, AttentionPlan
from lit_smd.losses.head import output_head
from lit_smd.losses.logprobs import token_logprobs_and_entropy
from lit_smd.rollout import Rollout

__all__ = [
    "LEARNER_LAYOUTS",
    "LearnerLayout",
    "LearnerPass",
    "check_learner_layout",
    "dense_hidden_states",
    "learner_hidden_states",
    "score",
    "shareable_groups",
]

LearnerLayout = Literal["shared_prefix", "per_row"]
LEARNER_LAYOUTS: tuple[str, ...] = ("shared_prefix", "per_row")

TEACHER_TOKENS = 1 << 11
"""Most tokens of one decoder call of `dense_hidden_states` (at least one row, or one slot of a packed row; the packed
teacher on FlexAttention is one call, `_dense_slots_in_chunks`): the teacher runs without gradient while the masked
pass's activations are held, so its per-layer transient sets SMD's peak; in chunks it is one chunk's, not the batch's.
At 8192 two 4k rows of the 2-layer benchmark model shared a call and SMD's peak was 1.19x dense's; at 2048, 1.11x,
for about 5% more teacher time (one more call per row); 2048 tokens still fill a GPU's matmuls at Qwen3 widths. The
packed slots one per call at 2 x 2k: 62.6 -> 57.4 MiB of tensors at SMD's peak (dense: 55.5)."""


def check_learner_layout(layout: object, name: str = "learner_layout") -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``layout`` is one of `LEARNER_LAYOUTS`."""
    if layout not in LEARNER_LAYOUTS:
        raise ValueError(f"{name} must be one of {LEARNER_LAYOUTS}, got {layout!r}")


@dataclass
class LearnerPass:
    """Hidden states of one learner pass, and what SMD's dense teacher can reuse from it (`dense_hidden_states`).

    Attributes:
        hidden: ``[B, N, H]`` final hidden states: row ``b``, index ``t`` is the decoder output at logical position
            ``prompt_length[b] + t - 1``, whose logits predict completion token ``t`` (positions past a
            completion's end are computed but meaningless).
        backend: The masked attention kernel the pass ran with.
    """

    hidden: Tensor
    backend: Backend
    _packing: _Packing | None = None  # None: every row ran per row
    _prompt_hidden: Tensor | None = None  # [R, W, H] the packed prompts' hidden states, detached (keep_prompt_kv)
    _fallback: Tensor | None = None  # [b'] rollout rows that ran per row beside the packing, or whose prompt differs
    _row_prompt_kv: dict[int, tuple[Tensor, Tensor]] | None = None  # per row: layer -> [B, Hkv, P_max, D] (kept)


def learner_hidden_states(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    shadow: bool = True,
    layout: LearnerLayout = "shared_prefix",
    backend: Backend = "auto",
    keep_prompt_kv: bool = False,
) -> LearnerPass:
    """Final hidden states predicting each completion token, in one teacher-forced pass of the chosen layout.

    Args:
        model: A Hugging Face causal LM (``get_decoder()`` returns its base model).
        rollout: Sampled completions, the samples of a prompt in consecutive rows.
        shadow: Replay the rollout's shadow mask (the learner view of SMD). With ``False``, or a rollout without a
            shadow mask, the pass is dense (causal + padding).
        layout: ``"shared_prefix"`` (each prompt encoded once per group; rows that cannot share fall back to the
            per-row pass) or ``"per_row"``.
        backend: Masked attention kernel: ``"sdpa"``, ``"flex"`` (CUDA, FlexAttention) or ``"auto"``.
        keep_prompt_kv: Keep the prompts' keys / values (detached copies) so that `dense_hidden_states` reuses them.

    Returns:
        A `LearnerPass`; its ``hidden`` is ``[B, N, H]``, differentiable. Works under activation checkpointing; the
        model's training mode is left as it is.

    Raises:
        ValueError: ``layout`` is not one of `LEARNER_LAYOUTS`, or ``backend`` not one of
            `lit_smd.kv.flex.BACKENDS`.
    """
    check_learner_layout(layout, "layout")
    check_backend(backend)
    ensure_attention(model)
    if layout == "per_row" or len(rollout) == 0:
        return _per_row_pass(model, rollout, shadow=shadow, backend=backend, keep_prompt_kv=keep_prompt_kv)
    shareable, group = shareable_groups(rollout, shadow=shadow)
    rows, fallback = shareable.nonzero().flatten(), (~shareable).nonzero().flatten()
    if rows.numel() == 0:
        return LearnerPass(_per_row_hidden_states(model, rollout, shadow=shadow, backend=backend), backend)
    packing = _pack(rollout, rows, group, shadow=shadow, backend=backend, capture=keep_prompt_kv)
    packed = _run_decoder(model, packing.ids, packing.positions, packing.plan)  # [R, W + S*N, H]
    hidden = _assemble(rollout, packing, packed, fallback, model, shadow=shadow, backend=backend)
    # A copy, not a view: a view would keep the whole packed hidden states alive with the pass.
    prompt_hidden = packed[:, : packing.plan.prompt_width].detach().clone() if keep_prompt_kv else None
    return LearnerPass(hidden, backend, packing, prompt_hidden, fallback)


@torch.no_grad()
def dense_hidden_states(model: torch.nn.Module, rollout: Rollout, masked: LearnerPass) -> Tensor:
    """``[B, N, H]`` hidden states of the dense view of ``rollout``, without gradient: SMD's dense teacher.

    Args:
        model: The model ``masked`` ran with.
        rollout: The rollout ``masked`` ran over.
        masked: A pass of `learner_hidden_states` (typically the shadow view). Its packed rows reuse the prompt keys
            / values it kept (``keep_prompt_kv=True``; the prompt's hidden states are the same in both views) and
            run only their completions; so do the rows of a per-row pass whose prompt no eviction touched before
            the prompt ended. Other rows run the dense per-row pass. Without kept keys this is a plain dense pass.
    """
    packing = masked._packing
    if packing is None and masked._row_prompt_kv:
        return _dense_completions_per_row(model, rollout, masked)
    if packing is None:
        return _dense_rows_in_chunks(model, rollout, masked.backend)
    if not packing.plan.prompt_kv:
        return learner_hidden_states(model, rollout, shadow=False, backend=masked.backend).hidden
    packed = torch.cat([masked._prompt_hidden, _dense_slots_in_chunks(model, packing)], dim=1)  # [R, W + S*N, H]
    return _assemble(rollout, packing, packed, masked._fallback, model, shadow=False, backend=masked.backend)


def _dense_slots_in_chunks(model: torch.nn.Module, packing: _Packing) -> Tensor:
    """``[R, S*N, H]``: the dense view of every slot over its packed row's kept prompt keys (`PackedPlan.for_slots`),
    `TEACHER_TOKENS` at a time (at least one slot per call): the slots are independent there, and a call's per-layer
    transient is the teacher's share of SMD's peak. On FlexAttention one call, as the masked pass: every other
    batch or width would be one more compiled shape."""
    plan, width, new = packing.plan.for_slots(), packing.plan.prompt_width, packing.plan.slot_width
    rows, slots = len(plan.prompt_lengths), plan.num_slots
    ids, positions = packing.ids[:, width:], packing.positions[:, width:]  # [R, S*N]
    per_call = max(1, TEACHER_TOKENS // new)  # slots per decoder call
    row_chunk, slot_chunk = max(1, per_call // slots), min(slots, per_call)
    if use_flex(plan.backend, ids.device, 0.0) or (row_chunk >= rows and slot_chunk == slots):
        return _run_decoder(model, ids, positions, plan)
    out = []
    for start in range(0, rows, row_chunk):
        part = slice(start, start + row_chunk)
        kept = {layer: (keys[part], values[part]) for layer, (keys, values) in plan.prompt_kv.items()}
        row_out = []
        for first in range(0, slots, slot_chunk):
            count = min(slot_chunk, slots - first)
            columns = slice(first * new, (first + count) * new)
            tokens = None if plan.slot_lengths is None else plan.slot_lengths[part, first : first + count]
            chunk = replace(plan, prompt_lengths=plan.prompt_lengths[part], num_slots=count, prompt_kv=kept,
                            slot_lengths=tokens, _masks={})  # fmt: skip
            row_out.append(_run_decoder(model, ids[part, columns], positions[part, columns], chunk))
        out.append(torch.cat(row_out, dim=1))  # [r, S*N, H]
    return torch.cat(out)


def score(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    shadow: bool = True,
    temperature: float = 1.0,
    backend: Backend = "auto",
    chunk_size: int = 1024,
) -> Tensor:
    """Teacher-forced log-probs of the completion tokens (one row per sample), differentiable.

    Replaying the shadow mask gives the learner's view: the rollout's own log-probs up to float reduction order.

    Args:
        model: The causal LM (same weights as the rollout's for the learner view).
        rollout: Sampled completions.
        shadow: Replay the rollout's shadow mask (the learner view); ``False`` for the dense view.
        temperature: The rollout's sampling temperature.
        backend: Masked attention kernel: ``"sdpa"``, ``"flex"`` (CUDA, FlexAttention) or ``"auto"``.
        chunk_size: Tokens per chunk of the vocabulary projection (`lit_smd.losses.logprobs`): the ``[B, N, V]``
            logits are never built.

    Returns:
        ``[B, N]`` log-probs of the temperature-scaled full-vocabulary distribution (0 where
        ``rollout.completion_mask`` is False).
    """
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    check_backend(backend)
    head = output_head(model)  # refuses unknown logit post-processing before the forward
    ensure_attention(model)
    hidden = _per_row_hidden_states(model, rollout, shadow=shadow, backend=backend)  # [B, N, H]
    return token_logprobs_and_entropy(
        hidden, head, rollout.completion_ids, temperature=temperature, chunk_size=chunk_size,
        mask=rollout.completion_mask,
    )[0]  # [B, N], 0 at padding (not projected), one [chunk_size, V] block of logits at a time


# --------------------------------------------------------------------------------------------------------- per row


def _per_row_batch(rollout: Rollout, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ``[B, T]`` ids whose column index is the logical position, lengths ``[B]`` and prompt lengths."""
    prompt_lengths = rollout.prompt_lengths  # [B]
    width = rollout.prompt_ids.shape[1]
    new = rollout.completion_ids.shape[1]
    columns = torch.arange(width + new, device=rollout.prompt_ids.device)[None, :]  # [1, T]
    # Column c of row b holds logical position c: prompt token c, or completion token c - prompt_length.
    shift = (width - prompt_lengths)[:, None]  # left pads of each row
    joined = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)  # [B, P + N], pads in front
    source = (columns + shift).clamp(max=width + new - 1)
    ids = joined.gather(1, source)
    lengths = prompt_lengths + rollout.completion_lengths
    ids = ids.masked_fill(columns >= lengths[:, None], pad_token_id)
    return ids, lengths, prompt_lengths


def _dense_rows_in_chunks(model: torch.nn.Module, rollout: Rollout, backend: Backend) -> Tensor:
    """`_per_row_hidden_states` of the dense view, `TEACHER_TOKENS` at a time when no gradient is recorded."""
    width = rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1]
    rows = max(1, TEACHER_TOKENS // width)
    if torch.is_grad_enabled() or rows >= len(rollout):
        return _per_row_hidden_states(model, rollout, shadow=False, backend=backend)
    rollout = replace(rollout, shadow_mask=None)  # the dense view: no eviction steps to copy per chunk
    return torch.cat([
        _per_row_hidden_states(model, rollout[start : start + rows], shadow=False, backend=backend)
        for start in range(0, len(rollout), rows)
    ])  # fmt: skip


def _per_row_pass(
    model: torch.nn.Module, rollout: Rollout, *, shadow: bool, backend: Backend, keep_prompt_kv: bool
) -> LearnerPass:
    """The per-row layout's `LearnerPass`; with ``keep_prompt_kv``, the rows' prompt keys / values kept for the dense
    teacher, and the rows whose prompt the shadow view encodes differently from the dense one (``_fallback``)."""
    if not keep_prompt_kv:
        return LearnerPass(_per_row_hidden_states(model, rollout, shadow=shadow, backend=backend), backend)
    shareable, _ = shareable_groups(rollout, shadow=shadow)
    prompt_kv = {} if bool(shareable.any()) else None
    hidden = _per_row_hidden_states(model, rollout, shadow=shadow, backend=backend, prompt_kv=prompt_kv)
    fallback = (~shareable).nonzero().flatten()
    return LearnerPass(hidden, backend, _fallback=fallback, _row_prompt_kv=prompt_kv)


def _dense_completions_per_row(model: torch.nn.Module, rollout: Rollout, masked: LearnerPass) -> Tensor:
    """`dense_hidden_states` of a per-row pass that kept its prompts' keys / values: the rows whose prompt is the
    dense view's run only their completions over the kept keys (a one-slot `PackedPlan.for_slots` pass per chunk of
    `TEACHER_TOKENS`), the others a dense per-row pass."""
    fallback = masked._fallback
    reused = torch.ones(len(rollout), dtype=torch.bool, device=fallback.device)
    reused[fallback] = False
    reused = reused.nonzero().flatten()  # [b]
    device = rollout.completion_ids.device
    num_new = rollout.completion_ids.shape[1]
    new = max(1, int(rollout.completion_lengths[reused].max()))  # trailing all-pad columns predict nothing
    chunk = max(1, TEACHER_TOKENS // new)
    parts, order = [], [reused]
    for start in range(0, len(reused), chunk):
        rows = reused[start : start + chunk]  # [c]
        lengths = rollout.prompt_lengths[rows]  # [c]
        width = int(lengths.max())
        kept = {layer: (keys[rows, :, :width], values[rows, :, :width])
                for layer, (keys, values) in masked._row_prompt_kv.items()}  # fmt: skip
        tokens = rollout.completion_lengths[rows].clamp(max=new)[:, None]  # [c, 1]
        plan = PackedPlan(prompt_lengths=lengths, prompt_width=width, num_slots=1, slot_width=new, prompt_kv=kept,
                          backend=masked.backend, slot_lengths=tokens)  # fmt: skip
        positions = lengths[:, None] + torch.arange(new, device=device)[None, :]  # [c, n] logical positions
        completions = _run_decoder(model, rollout.completion_ids[rows, :new], positions, plan.for_slots())  # [c, n, H]
        # Completion token 0 is predicted by the last prompt token, whose state the masked pass computed densely.
        hidden = torch.cat([masked.hidden[rows, :1].detach(), completions[:, : new - 1]], dim=1)  # [c, n, H]
        parts.append(F.pad(hidden, (0, 0, 0, num_new - new)))
    if fallback.numel():
        parts.append(_dense_rows_in_chunks(model, rollout.select(fallback), masked.backend))
        order.append(fallback)
    return _in_rollout_order(parts, order)


def _per_row_hidden_states(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    shadow: bool,
    backend: Backend,
    prompt_kv: dict[int, tuple[Tensor, Tensor]] | None = None,
) -> Tensor:
    """``[B, N, H]`` hidden states (see `LearnerPass.hidden`) from one right-padded row per sample; each layer's keys
    / values of the prompt columns ``[0, max prompt length)`` are copied into ``prompt_kv`` when one is given."""
    ids, lengths, prompt_lengths = _per_row_batch(rollout, pad_token_id=0)
    width = ids.shape[1]
    mask = rollout.shadow_mask if shadow else None
    if mask is not None and mask.length < width:
        mask = mask.padded_to(width)
    capture = 0 if prompt_kv is None else int(prompt_lengths.max())
    plan = AttentionPlan(
        lengths=lengths, shadow=mask, backend=backend, capture_prompt_width=capture,
        prompt_kv={} if prompt_kv is None else prompt_kv, prompt_lengths=prompt_lengths,
    )  # fmt: skip
    positions = torch.arange(width, device=ids.device)[None, :].expand(ids.shape[0], -1)
    hidden = model.get_decoder()(
        input_ids=ids, position_ids=positions, attention_plan=plan, use_cache=False
    ).last_hidden_state  # [B, T, H]
    new = rollout.completion_ids.shape[1]
    rows = (prompt_lengths - 1)[:, None] + torch.arange(new, device=ids.device)[None, :]  # [B, N]
    return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, N, H]


# --------------------------------------------------------------------------------------------------- shared prefix


def shareable_groups(rollout: Rollout, *, shadow: bool) -> tuple[Tensor, Tensor]:
    """Which rows can share their prompt's encoding, and the group each belongs to.

    Args:
        rollout: The batch.
        shadow: Whether the pass replays the shadow mask (then rows whose prompt keys were evicted before the prompt
            ended cannot be packed).

    Returns:
        ``(shareable [B] bool, group [B] long)``: consecutive shareable rows with equal prompts share a group id
        (ids count from 0 over shareable rows; -1 for the others).
    """
    prompt_lengths = rollout.prompt_lengths  # [B]
    shareable = torch.ones(len(rollout), dtype=torch.bool, device=prompt_lengths.device)
    if shadow and rollout.shadow_mask is not None:
        steps = rollout.shadow_mask.evict_steps  # [L, B, Hkv, T]
        keys = torch.arange(steps.shape[-1], device=steps.device)
        in_prompt = keys[None, :] < prompt_lengths[:, None]  # [B, T]
        limit = prompt_lengths.to(steps.dtype)[None, :, None, None]  # compared in the mask's int32: no int64 copy
        early = (steps < limit) & in_prompt[None, :, None, :]  # [L, B, Hkv, T]
        shareable = ~early.any(dim=3).any(dim=2).any(dim=0)
    prompts = rollout.prompt_ids.masked_fill(~rollout.prompt_mask, -1)  # pads may hold any id
    same_prompt = torch.cat([torch.zeros(1, dtype=torch.bool, device=shareable.device),
                             (prompts[1:] == prompts[:-1]).all(dim=1) & shareable[:-1]])  # fmt: skip
    starts = shareable & ~same_prompt
    group = torch.where(shareable, starts.long().cumsum(0) - 1, -1)
    return shareable, group


@dataclass
class _Packing:
    """A rollout's shareable rows packed into ``R`` shared-prefix rows."""

    plan: PackedPlan
    ids: Tensor  # [R, W + S*N]
    positions: Tensor  # [R, W + S*N]
    rows: Tensor  # [b] rollout rows in the packing
    columns: Tensor  # [b, N] packed column whose output predicts each completion token
    packed_row: Tensor  # [b] packed row of each rollout row


def _pack(rollout: Rollout, rows: Tensor, group: Tensor, *, shadow: bool, backend: Backend, capture: bool) -> _Packing:
    device = rollout.prompt_ids.device
    prompt_lengths = rollout.prompt_lengths[rows]  # [b]
    completion_lengths = rollout.completion_lengths
    new = max(1, int(completion_lengths.max()))  # trailing all-pad columns predict nothing
    group = group[rows]
    num_rows = int(group.max()) + 1
    first = torch.full((num_rows,), len(rollout), dtype=torch.long, device=device).scatter_reduce(
        0, group, rows, reduce="amin"
    )  # [R] first rollout row of each group
    slot = rows - first[group]  # [b] rank within the group (groups are consecutive rows)
    num_slots = int(slot.max()) + 1
    lengths = rollout.prompt_lengths[first]  # [R]
    width = int(lengths.max())
    prompt_width = rollout.prompt_ids.shape[1]

    # Prompt region: real tokens left-aligned (the rollout's left padding becomes right padding).
    columns = torch.arange(width, device=device)
    source = (columns[None, :] + (prompt_width - lengths)[:, None]).clamp(max=prompt_width - 1)
    prompt = rollout.prompt_ids[first].gather(1, source).masked_fill(columns[None, :] >= lengths[:, None], 0)
    slots = torch.zeros(num_rows, num_slots, new, dtype=prompt.dtype, device=device)
    slots[group, slot] = rollout.completion_ids[rows, :new]
    ids = torch.cat([prompt, slots.flatten(1)], dim=1)  # [R, W + S*N]
    t = torch.arange(new, device=device)
    slot_positions = (lengths[:, None] + t[None, :]).repeat(1, num_slots)  # [R, S*N]
    positions = torch.cat([columns[None, :].expand(num_rows, -1), slot_positions], dim=1)

    steps = None
    if shadow and rollout.shadow_mask is not None:
        mask = rollout.shadow_mask
        mask = mask.padded_to(max(mask.length, width + new))
        own = prompt_lengths[:, None] + t[None, :]  # [b, N] logical positions of each row's slot tokens
        picked = mask.evict_steps[:, rows]  # [L, b, Hkv, T]
        index = own[None, :, None, :].expand(picked.shape[0], -1, picked.shape[2], -1)
        per_row = torch.cat([picked[..., :width], picked.gather(-1, index)], dim=-1)  # [L, b, Hkv, W + N]
        packed = torch.full((num_rows, num_slots, *per_row.shape[:1], *per_row.shape[2:]), NEVER,
                            dtype=per_row.dtype, device=device)  # fmt: skip
        packed[group, slot] = per_row.permute(1, 0, 2, 3)
        steps = packed.permute(2, 0, 3, 1, 4).contiguous()  # [L, R, Hkv, S, W + N]
    slot_lengths = torch.zeros(num_rows, num_slots, dtype=torch.long, device=device)  # [R, S]; empty slots 0
    slot_lengths[group, slot] = completion_lengths[rows].to(device).clamp(max=new)
    plan = PackedPlan(
        prompt_lengths=lengths, prompt_width=width, num_slots=num_slots, slot_width=new, steps=steps, backend=backend,
        capture_prompt_kv=capture, slot_lengths=slot_lengths,
    )  # fmt: skip
    # Completion token 0 is predicted by the last prompt token, token t >= 1 by slot column t - 1.
    predicting = width + slot[:, None] * new + t[None, :] - 1  # [b, N]
    predicting[:, 0] = prompt_lengths - 1
    return _Packing(plan, ids, positions, rows, predicting, group)


def _run_decoder(model: torch.nn.Module, ids: Tensor, positions: Tensor, plan: PackedPlan) -> Tensor:
    # A "prepared" 4-D mask, so transformers builds none (an all-ones 2-D mask still gets a [R, 1, T, T] one on
    # sliding-window models): the plan masks.
    no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device)
    return model.get_decoder()(
        input_ids=ids, position_ids=positions, attention_mask=no_mask, attention_plan=plan, use_cache=False
    ).last_hidden_state  # [R, T, H]


def _assemble(
    rollout: Rollout, packing: _Packing, packed: Tensor, fallback: Tensor, model, *, shadow: bool, backend: Backend
) -> Tensor:
    """``[B, N, H]`` from the packed rows' hidden states plus a per-row pass over the ``fallback`` rows."""
    num_new = rollout.completion_ids.shape[1]
    picked = packed[packing.packed_row[:, None], packing.columns]  # [b, n, H]
    parts, order = [F.pad(picked, (0, 0, 0, num_new - picked.shape[1]))], [packing.rows]
    if fallback.numel():
        parts.append(_per_row_hidden_states(model, rollout.select(fallback), shadow=shadow, backend=backend))
        order.append(fallback)
    return _in_rollout_order(parts, order)


def _in_rollout_order(parts: list[Tensor], order: list[Tensor]) -> Tensor:
    """``[B, ...]``: the rows of ``parts`` (each ``[b_i, ...]``) put back at the rollout rows ``order`` gives them."""
    rows = torch.cat(order)  # [B], a permutation of the rollout's rows
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(len(rows), device=rows.device)
    return torch.cat(parts)[inverse]
