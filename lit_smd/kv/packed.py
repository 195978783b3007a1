"""Shared-prefix attention for the learner: one packed row per prompt group, masked only where it differs from causal.

The G completions of a GRPO group share one prompt. Instead of encoding the prompt G times (one row per sample), the
learner packs each group into one row::

    columns  [0, W)                       [W, W + N)   [W + N, W + 2N)   ...   [W + (S-1)N, W + SN)
    tokens   prompt (right-padded to W)   slot 0       slot 1            ...   slot S-1

with position ids that restart at the group's prompt length ``P`` in every slot (slot column ``t`` is logical position
``P + t``). A prompt query attends causally to the prompt; a slot query attends to the prompt's ``P`` real keys and to
its own slot's earlier tokens, never to another slot. The prompt is therefore encoded once, with gradient, and the
gradient reaching it is the sum over its completions: the same log-probs and gradients as the per-row pass.

Under the shadow mask (`lit_smd.kv.shadow`: query ``i`` sees key ``j`` iff ``j <= i < e[j]``, logical positions, per
layer and KV head) the slot queries additionally need ``i < e[j]`` for the eviction steps of *their own* rollout row.
The prompt queries stay plain causal: sharing is only used when no prompt key was evicted before the prompt ended
(``e[j] >= P`` for every prompt key, which holds for SnapKV-style prefill drops, recorded as ``e = P``), so the
prompt's hidden states are those of the dense view. `lit_smd.learner` decides this and falls back to the
per-row pass otherwise.

Attention per layer (SDPA path, any device):

* prompt queries ``[R, H_q, W]`` over the prompt keys with ``is_causal`` (the fused causal kernel; a boolean mask only
  for sliding-window layers shorter than ``W``);
* slot queries with the slots in the batch: each slot's ``N`` queries attend to ``[prompt keys | its own N keys]``
  (``W + N`` columns, the prompt keys copied per slot), with a boolean mask ``[R*S, 1, N, W + N]`` for the dense view
  and ``[R*S, H_kv, N, W + N]`` under the shadow mask. The KV heads are then folded into the batch (``[R*S*H_kv, G,
  N, D]`` queries over ``[R*S*H_kv, 1, W + N, D]`` keys), so a mask row serves the ``G`` query heads of its KV head
  without being repeated. Nothing grows with ``(S*N)^2``: the cost is that of ``S`` rows of ``W + N`` keys.

Nothing of shape ``[rows, heads, T, T]`` is built or kept for backward. The slot attention is checkpointed under
autograd: SDPA on CPU would keep a float copy of its mask (and the per-slot key copies and output) for the backward;
they are rebuilt there instead, from the query / key / value slices the prompt's fused causal attention keeps
anyway. On CUDA the default backend is FlexAttention over the whole packed row with a `BlockMask`, which skips fully
masked blocks and applies no mask in fully visible ones.

Reusing the prompt (the dense teacher of SMD): a pass built with ``capture_prompt_kv=True`` keeps every layer's prompt
keys and values (detached). `PackedPlan.for_slots` then describes a pass over the slot tokens only that attends to
those stored prompt keys: the dense view of the completions without re-encoding the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.utils.checkpoint import checkpoint

from lit_smd.kv.features import PLAIN, AttentionFeatures, attention, softmax_dtype
from lit_smd.kv.flex import Backend, flex_feature_attention, packed_block_mask, use_flex

__all__ = ["PackedPlan"]


@dataclass
class PackedPlan:
    """How the registered attention function runs one pass over packed shared-prefix rows (see module docstring).

    Attributes:
        prompt_lengths: ``[R]`` real prompt tokens of each packed row (``1 <= P <= prompt_width``).
        prompt_width: ``W``, columns of the prompt region.
        num_slots: ``S``, completion slots per packed row.
        slot_width: ``N``, columns per slot.
        steps: ``[L, R, H_kv, S, W + N]`` eviction steps of each slot's rollout row: columns ``[0, W)`` for the
            prompt keys (logical position = column), ``[W, W + N)`` for the slot's own tokens (logical ``P + t``).
            None for the dense view.
        backend: ``"sdpa"``, ``"flex"`` (FlexAttention, CUDA) or ``"auto"`` (flex on CUDA, sdpa elsewhere).
        capture_prompt_kv: Keep each layer's prompt keys / values (detached) in ``prompt_kv``.
        prompt_kv: Layer index -> ``(keys [R, H_kv, W, D], values)``: filled by a capturing pass; in a slots-only
            pass (`for_slots`) the prompt keys the slot queries attend to.
        slots_only: The pass holds the slot columns only (``S*N`` tokens) and reads the prompt from ``prompt_kv``.
    """

    prompt_lengths: torch.Tensor
    prompt_width: int
    num_slots: int
    slot_width: int
    steps: torch.Tensor | None = None
    backend: Backend = "auto"
    capture_prompt_kv: bool = False
    prompt_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    slots_only: bool = False
    _masks: dict[object, object] = field(default_factory=dict, repr=False)

    @property
    def width(self) -> int:
        """Columns of a full packed row, ``W + S*N``."""
        return self.prompt_width + self.num_slots * self.slot_width

    def for_slots(self) -> PackedPlan:
        """The dense slots-only pass that reuses this (capturing) pass's prompt keys and values."""
        if not self.prompt_kv:
            raise ValueError("for_slots needs a pass run with capture_prompt_kv=True first (no prompt keys stored)")
        return replace(self, steps=None, backend="sdpa", capture_prompt_kv=False, slots_only=True, _masks={})

    # ------------------------------------------------------------------------------------------------ attention

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
        dropout: float, sliding_window: int | None, features: AttentionFeatures = PLAIN,
    ) -> torch.Tensor:
        """Attention output ``[R, T_q, H_q, D]`` for ``query [R, H_q, T_q, D]``, ``key / value [R, H_kv, T_k, D]``.

        ``features`` (softcap, sinks; `lit_smd.kv.features`) apply to the prompt and the slot queries alike.
        """
        width = self.prompt_width
        if self.slots_only:
            prompt_keys, prompt_values = self.prompt_kv[layer_idx]
            out = self._attend_slots(layer_idx, query, prompt_keys, prompt_values, key, value, scaling, dropout,
                                     sliding_window, features)  # fmt: skip
            return out.transpose(1, 2).contiguous()
        if self.capture_prompt_kv:
            self.prompt_kv[layer_idx] = (key[:, :, :width].detach(), value[:, :, :width].detach())
        if use_flex(self.backend, query.device, dropout):
            block_mask = self._block_mask(layer_idx, query.shape[1], sliding_window)
            return flex_feature_attention(query, key, value, block_mask, scaling, features).transpose(1, 2).contiguous()
        windowed = sliding_window is not None and sliding_window < width
        prompt_mask = self._prompt_window_mask(sliding_window, query.device) if windowed else None  # None = causal
        prompt_out = attention(
            query[:, :, :width], key[:, :, :width], value[:, :, :width], prompt_mask, scaling, features, dropout=dropout
        )  # [R, Hq, W, D]
        slot_out = self._attend_slots(
            layer_idx, query[:, :, width:], key[:, :, :width], value[:, :, :width], key[:, :, width:],
            value[:, :, width:], scaling, dropout, sliding_window, features,
        )  # fmt: skip
        return torch.cat([prompt_out, slot_out], dim=2).transpose(1, 2).contiguous()

    def _attend_slots(
        self, layer_idx, query, prompt_key, prompt_value, slot_key, slot_value, scaling, dropout, sliding_window,
        features,
    ) -> torch.Tensor:
        """Slot queries ``[R, H_q, S*N, D]`` over the prompt keys ``[R, H_kv, W, D]`` and the slot keys
        ``[R, H_kv, S*N, D]`` -> ``[R, H_q, S*N, D]``.

        Each slot is its own batch entry: its ``N`` queries over ``[prompt keys | its own N keys]`` (``W + N``
        columns), so nothing grows with the square of ``S*N``. Under autograd the computation is checkpointed: its
        copies of the keys, its float mask and its output are rebuilt in the backward pass instead of being kept
        (the inputs are slices of tensors the prompt's attention keeps anyway).
        """

        def slot_attention(query, prompt_key, prompt_value, slot_key, slot_value):
            rows, q_heads, _, dim = query.shape
            kv_heads, width, slots, new = prompt_key.shape[1], self.prompt_width, self.num_slots, self.slot_width
            group = q_heads // kv_heads

            def per_slot(prompt: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
                # [R, Hkv, W, D], [R, Hkv, S*N, D] -> [R, S, Hkv, W + N, D]
                prompt = prompt[:, None].expand(rows, slots, kv_heads, width, dim)
                return torch.cat([prompt, own.unflatten(2, (slots, new)).transpose(1, 2)], dim=3)

            keys, values = per_slot(prompt_key, slot_key), per_slot(prompt_value, slot_value)
            queries = query.unflatten(2, (slots, new)).transpose(1, 2)  # [R, S, Hq, N, D]
            mask = self._slot_mask(layer_idx, sliding_window, query.device)  # [R*S, 1 or Hkv, N, W + N]
            if mask.shape[1] == 1 or kv_heads == 1:
                batch, q_split, kv_split = rows * slots, q_heads, kv_heads
            else:  # one mask row per KV head: fold the KV heads into the batch, the mask broadcasts over each group
                batch, q_split, kv_split = rows * slots * kv_heads, group, 1
            sinks = None
            if features.sinks is not None:  # [batch, q_split, 1, 1]: query head (batch % Hkv) * G + g when folded
                sinks = features.sinks.to(softmax_dtype(query.dtype)).view(1, -1, q_split, 1, 1)
                sinks = sinks.expand(batch // sinks.shape[1], -1, -1, -1, -1).reshape(batch, q_split, 1, 1)
            out = attention(
                queries.reshape(batch, q_split, new, dim),
                keys.reshape(batch, kv_split, width + new, dim),
                values.reshape(batch, kv_split, width + new, dim),
                mask.reshape(batch, -1, new, width + new),
                scaling,
                features,
                dropout=dropout,
                sinks=sinks,
            )  # [R*S(*Hkv), Hq (or G), N, D]
            return out.reshape(rows, slots, q_heads, new, dim).transpose(1, 2).reshape(rows, q_heads, slots * new, dim)

        inputs = (query, prompt_key, prompt_value, slot_key, slot_value)
        if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
            return checkpoint(slot_attention, *inputs, use_reentrant=False)
        return slot_attention(*inputs)

    # ---------------------------------------------------------------------------------------------------- masks

    def _prompt_window_mask(self, sliding_window: int, device: torch.device) -> torch.Tensor:
        """``[1, 1, W, W]`` causal sliding-window mask of the prompt queries."""
        key = ("prompt", sliding_window)
        if key not in self._masks:
            positions = torch.arange(self.prompt_width, device=device)
            distance = positions[:, None] - positions[None, :]
            self._masks[key] = ((distance >= 0) & (distance < sliding_window))[None, None]
        return self._masks[key]

    def _slot_mask(self, layer_idx: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
        """Boolean visibility ``[R*S, 1 or H_kv, N, W + N]`` of each slot's queries over the prompt keys (columns
        ``[0, W)``) and the slot's own keys (columns ``[W, W + N)``); the dense view's is one for all layers."""
        cache_key = ("slots", sliding_window) if self.steps is None else None
        if cache_key in self._masks:
            return self._masks[cache_key]
        rows, width, slots, new = self.prompt_lengths.shape[0], self.prompt_width, self.num_slots, self.slot_width
        lengths = self.prompt_lengths.to(device)
        t = torch.arange(new, device=device)
        c = torch.arange(width, device=device)
        query_pos = lengths[:, None] + t[None, :]  # [R, N] logical positions of the slot queries
        prompt_vis = (c[None, None, :] < lengths[:, None, None]).expand(rows, new, width)  # [R, N, W]
        own_vis = (t[None, :] <= t[:, None])[None].expand(rows, new, new)  # [R, N, N] causal within the slot
        if sliding_window is not None:
            prompt_vis = prompt_vis & ((query_pos[:, :, None] - c[None, None, :]) < sliding_window)
            own_vis = own_vis & ((t[:, None] - t[None, :]) < sliding_window)[None]
        visible = torch.cat([prompt_vis, own_vis], dim=-1)[:, None, None]  # [R, 1, 1, N, W + N]
        if self.steps is not None:
            steps = self.steps[layer_idx].to(device)  # [R, Hkv, S, W + N]
            visible = visible & (query_pos[:, None, None, :, None] < steps[:, :, :, None, :])  # [R, Hkv, S, N, W + N]
            visible = visible.transpose(1, 2)  # [R, S, Hkv, N, W + N]
        else:
            visible = visible.expand(rows, slots, 1, new, width + new)
        itself = torch.cat([torch.zeros(new, width, dtype=torch.bool, device=device),
                            torch.eye(new, dtype=torch.bool, device=device)], dim=1)  # fmt: skip
        mask = (visible | itself).reshape(rows * slots, -1, new, width + new)  # a query always sees itself: no NaN
        if cache_key is not None:
            self._masks[cache_key] = mask
        return mask

    def _block_mask(self, layer_idx: int, q_heads: int, sliding_window: int | None):
        """FlexAttention BlockMask of the whole packed row for one layer (`lit_smd.kv.flex.packed_block_mask`): the
        shadow view's is built per call and not kept; the dense view's once per plan and window."""
        steps = None if self.steps is None else self.steps[layer_idx]  # [R, Hkv, S, W + N]
        cache_key = ("block", sliding_window)
        if steps is None and cache_key in self._masks:
            return self._masks[cache_key]
        block_mask = packed_block_mask(
            self.prompt_lengths, self.prompt_width, self.num_slots, self.slot_width, steps, q_heads, sliding_window
        )
        if steps is None:
            self._masks[cache_key] = block_mask
        return block_mask
