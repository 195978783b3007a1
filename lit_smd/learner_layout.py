"""The learner's teacher-forced pass over a rollout batch: shared-prefix packing (default) or one row per sample.

``layout="shared_prefix"`` (the Prefix Grouper idea, arXiv 2506.05433, done with a packed row and our
shadow-mask replay): consecutive rows of a `Rollout` with the same prompt form a group, and each group becomes one
packed row ``[prompt | c_1 | ... | c_G]`` (`lit_smd.kv.packed`): the prompt is encoded once, with gradient, and each
completion attends to it and to its own earlier tokens. Log-probs and gradients equal the per-row pass's up to float
reduction order; the prompt work drops from ``G`` encodings to one.

A row is packed only when its prompt's hidden states are those of the dense view, i.e. in the shadow view no key of
its prompt was evicted before the prompt ended (``e[j] >= P`` for every prompt key ``j``; SnapKV-style prefill drops
are recorded as ``e = P`` and qualify). Other rows, and every row with ``layout="per_row"``, go through the per-row
pass `lit_smd.rollout.completion_hidden_states`. Groups are found from the data (equal prompts in consecutive rows),
so minibatches that split a group, groups of one and prompts that differ within a nominal group all work.

`LearnerPass.dense_hidden` gives SMD's dense teacher: for packed rows it reuses the prompt's keys and values from the
shadow-masked pass (detached) and runs only the completion tokens, densely, without gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_smd.kv.attention import ensure_attention
from lit_smd.kv.packed import PackedPlan
from lit_smd.kv.shadow import NEVER
from lit_smd.rollout import Rollout, completion_hidden_states

__all__ = [
    "LEARNER_LAYOUTS",
    "LearnerLayout",
    "LearnerPass",
    "check_learner_layout",
    "learner_hidden_states",
    "shareable_groups",
]

LearnerLayout = Literal["shared_prefix", "per_row"]
LEARNER_LAYOUTS: tuple[str, ...] = ("shared_prefix", "per_row")
Backend = Literal["auto", "sdpa", "flex"]


def check_learner_layout(layout: object, name: str = "learner_layout") -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``layout`` is one of `LEARNER_LAYOUTS`."""
    if layout not in LEARNER_LAYOUTS:
        raise ValueError(f"{name} must be one of {LEARNER_LAYOUTS}, got {layout!r}")


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
    plan = PackedPlan(
        prompt_lengths=lengths, prompt_width=width, num_slots=num_slots, slot_width=new, steps=steps, backend=backend,
        capture_prompt_kv=capture,
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


@dataclass
class LearnerPass:
    """Hidden states of one learner pass, and what SMD's dense teacher can reuse from it.

    Attributes:
        hidden: ``[B, N, H]`` final hidden states predicting each completion token (see
            `lit_smd.rollout.completion_hidden_states`; positions past a completion's end are meaningless).
    """

    hidden: Tensor
    _model: torch.nn.Module
    _rollout: Rollout
    _packing: _Packing | None
    _packed_hidden: Tensor | None
    _fallback: Tensor
    _backend: Backend

    @torch.no_grad()
    def dense_hidden(self) -> Tensor:
        """``[B, N, H]`` hidden states of the dense view, without gradient.

        Packed rows reuse the prompt keys / values the pass captured (``keep_prompt_kv=True``) and run only their
        completions; other rows run the per-row dense pass.
        """
        packing = self._packing
        if packing is None:
            return completion_hidden_states(self._model, self._rollout, shadow=False, backend=self._backend)
        if not packing.plan.prompt_kv:
            return learner_hidden_states(self._model, self._rollout, shadow=False, backend=self._backend).hidden
        plan = packing.plan
        width = plan.prompt_width
        slots = _run_decoder(self._model, packing.ids[:, width:], packing.positions[:, width:], plan.for_slots())
        packed = torch.cat([self._packed_hidden[:, :width].detach(), slots], dim=1)  # [R, T, H]
        return _assemble(
            self._rollout, packing, packed, self._fallback, self._model, shadow=False, backend=self._backend
        )


def _assemble(
    rollout: Rollout, packing: _Packing, packed: Tensor, fallback: Tensor, model, *, shadow: bool, backend: Backend
) -> Tensor:
    """``[B, N, H]`` from the packed rows' hidden states plus a per-row pass over the ``fallback`` rows."""
    num_new = rollout.completion_ids.shape[1]
    picked = packed[packing.packed_row[:, None], packing.columns]  # [b, n, H]
    parts, order = [F.pad(picked, (0, 0, 0, num_new - picked.shape[1]))], [packing.rows]
    if fallback.numel():
        parts.append(completion_hidden_states(model, rollout.select(fallback), shadow=shadow, backend=backend))
        order.append(fallback)
    inverse = torch.empty(len(rollout), dtype=torch.long, device=packed.device)
    inverse[torch.cat(order)] = torch.arange(len(rollout), device=packed.device)
    return torch.cat(parts)[inverse]


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
        shadow: Replay the rollout's shadow mask (the learner view of SMD); ``False`` for the dense view.
        layout: ``"shared_prefix"`` (each prompt encoded once per group; rows that cannot share fall back to the
            per-row pass) or ``"per_row"``.
        backend: Masked attention kernel: ``"sdpa"``, ``"flex"`` (CUDA, FlexAttention) or ``"auto"``.
        keep_prompt_kv: Keep the packed prompts' keys / values so that `LearnerPass.dense_hidden` reuses them.

    Returns:
        A `LearnerPass`; its ``hidden`` is ``[B, N, H]``, differentiable.

    Raises:
        ValueError: ``layout`` is not one of `LEARNER_LAYOUTS`.
    """
    check_learner_layout(layout, "layout")
    ensure_attention(model)
    none = torch.zeros(0, dtype=torch.long, device=rollout.prompt_ids.device)
    if layout == "per_row" or len(rollout) == 0:
        hidden = completion_hidden_states(model, rollout, shadow=shadow, backend=backend)
        return LearnerPass(hidden, model, rollout, None, None, none, backend)
    shareable, group = shareable_groups(rollout, shadow=shadow)
    rows, fallback = shareable.nonzero().flatten(), (~shareable).nonzero().flatten()
    if rows.numel() == 0:
        hidden = completion_hidden_states(model, rollout, shadow=shadow, backend=backend)
        return LearnerPass(hidden, model, rollout, None, None, none, backend)
    packing = _pack(rollout, rows, group, shadow=shadow, backend=backend, capture=keep_prompt_kv)
    packed = _run_decoder(model, packing.ids, packing.positions, packing.plan)
    hidden = _assemble(rollout, packing, packed, fallback, model, shadow=shadow, backend=backend)
    return LearnerPass(hidden, model, rollout, packing, packed, fallback, backend)
