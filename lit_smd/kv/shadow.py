"""Shadow Mask Distillation's core: the record of which keys each rollout token could see, and its replay.

SMD (Zhu, Bai, Wu, Ren, Tang and Liu, "How to Compress KV Cache in RL Post-Training? Shadow Mask Distillation for
Memory-Efficient Alignment", arXiv 2605.06850). A rollout under a compressed KV cache samples from a *sparse* policy:
each token was drawn while attending only to the keys still in the cache. A learner that scores the same tokens
densely is off-policy by however much the evicted keys mattered, and RL amplifies the gap (importance reweighting,
as in Sparse-RL, pays for it with variance and rejected samples). SMD records the shadow mask ``M`` (which keys each
query could see) during the rollout and replays it in the learner's attention, evicted keys masked out before the
softmax, so the learner's ``pi_theta(. | x, M)`` is the sampler's policy up to float rounding. A dense pass of the
same weights is the teacher of a KL term that keeps the masked view near the dense one (`lit_smd.modules.grpo`).

How it runs here:

1. Record (`lit_smd.kv.cache`): when the compressor evicts a key, the cache writes, for that layer, KV head, row and
   key, the first logical query position that no longer sees it. The rollout ends with a `ShadowMask`.
2. Replay: the learner's teacher-forced pass carries an attention plan, and the registered attention function
   (`lit_smd.kv.attention`) calls its ``attend``. `AttentionPlan` (here) replays ``M`` over one right-padded row
   per sample; `lit_smd.kv.packed.PackedPlan` over shared-prefix packed rows. `lit_smd.learner` builds both.

Contract (other code and tests rely on it):

* ``ShadowMask.evict_steps`` is an integer tensor ``[L, B, H_kv, T]`` in *logical* positions: position 0 is
  each sequence's first real prompt token (pads excluded), prompt then completion.
* In layer ``l``, KV head ``h`` of sequence ``b``, the query at logical position ``i`` can see the key at
  logical position ``j`` iff ``j <= i < evict_steps[l, b, h, j]``. Keys that were never evicted hold `NEVER`,
  larger than any position. A sliding-window layer additionally requires ``i - j < window``, as the model
  defines it.
* Query head ``q`` reads KV head ``q // G`` with ``G = H_q / H_kv`` (transformers' ``repeat_kv`` order).

Because positions are logical, the learner may use any padding layout. The learner never re-runs the
eviction rule (its decisions depend on attention numerics); it replays the record.

Departures from the paper (of which only the abstract could be read) and its public code
(github.com/huthvincent/RL-Post-Training-with-KV-Cache-Compression):

* The mask is the record of the compressed rollout that actually sampled the tokens, prefill and decode evictions
  alike (SnapKV, H2O, recent window, random), per layer and KV head. The public code compresses the prompt only,
  once, at prefill, and computes its masks after a dense rollout.
* It is stored as one eviction step per key, never as ``[T, T]`` masks: the replay computes visibility where it is
  used, per block of queries (`lit_smd.kv.blocked`, SDPA, any device; memory O(block x keys)) or in a FlexAttention
  ``mask_mod`` on CUDA (`lit_smd.kv.flex`), where the public code adds a ``-inf`` bias in eager ``O(T^2)`` attention.
* Evicted keys keep their original RoPE positions (StreamingLLM-style re-rotation could not be replayed by a mask).
* The objective (GRPO on the masked policy plus the KL to the dense view, its stop-gradient side configurable) and
  its departures are documented in `lit_smd.modules.grpo`.
"""


from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lit_smd.kv.blocked import NEVER
from lit_smd.kv.features import PLAIN, AttentionFeatures
from lit_smd.kv.flex import Backend, flex_feature_attention, row_block_mask, use_flex
from lit_smd.kv.flex_sorted import row_sorted_keys, sorted_attention
from lit_smd.kv.rows import causal_rows_attention

__all__ = ["NEVER", "AttentionPlan", "ShadowMask"]



@dataclass
class ShadowMask:
    """Eviction steps recorded by a compressed rollout (see the module docstring for the contract).

    Attributes:
        evict_steps: ``[L, B, H_kv, T]`` int32, logical positions.
    """

    evict_steps: torch.Tensor

    def __post_init__(self) -> None:
        if self.evict_steps.ndim != 4 or self.evict_steps.is_floating_point():
            raise ValueError(
                f"ShadowMask.evict_steps must be an integer tensor [L, B, H_kv, T], got "
                f"{self.evict_steps.dtype} {tuple(self.evict_steps.shape)}"
            )

    @property
    def num_layers(self) -> int:
        return self.evict_steps.shape[0]

    @property
    def length(self) -> int:
        return self.evict_steps.shape[-1]

    @property
    def nbytes(self) -> int:
        """Size of the record in bytes."""
        return self.evict_steps.nbytes

    def to(self, device: torch.device | str) -> ShadowMask:
        return ShadowMask(self.evict_steps.to(device))

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> ShadowMask:
        """Rows ``index`` of the batch."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, device=self.evict_steps.device)
        return ShadowMask(self.evict_steps[:, index])

    def padded_to(self, length: int) -> ShadowMask:
        """The same record over ``length >= T`` logical positions (the extra keys are never evicted)."""
        return ShadowMask(F.pad(self.evict_steps, (0, length - self.length), value=NEVER))

    @staticmethod
    def cat(masks: Sequence[ShadowMask]) -> ShadowMask:
        """Concatenate along the batch, padding the position axis with `NEVER`."""
        length = max(mask.length for mask in masks)
        return ShadowMask(torch.cat([mask.padded_to(length).evict_steps for mask in masks], dim=1))

    def visible_fraction(self, prompt_lengths: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
        """Mean share of the causally available keys that the generated tokens could see.

        Each completion token ``t`` of row ``b`` was sampled by the query at logical position
        ``i = prompt_lengths[b] + t - 1``, which causally has ``i + 1`` keys; it could see those with
        ``evict_steps > i``. The share is averaged over layers, KV heads and all real completion tokens.

        Args:
            prompt_lengths: ``[B]`` real prompt lengths.
            completion_mask: ``[B, N]`` True on real completion tokens.

        Returns:
            0-d float tensor in [0, 1] (1.0 when nothing was evicted, NaN-free for empty completions: 1.0).
        """
        steps = self.evict_steps.long().clamp(max=self.length)  # [L, B, H, T]; never evicted -> T
        evicted_by = torch.zeros(*steps.shape[:-1], self.length + 1, device=steps.device)
        evicted_by.scatter_add_(-1, steps, torch.ones_like(steps, dtype=evicted_by.dtype))
        evicted_by = evicted_by.cumsum(dim=-1)  # [..., i] = keys with evict_step <= i (all have j < i)
        num_new = completion_mask.shape[1]
        queries = prompt_lengths[:, None] + torch.arange(num_new, device=steps.device)[None, :] - 1  # [B, N]
        queries = queries.clamp(max=self.length - 1)
        index = queries[None, :, None, :].expand(steps.shape[0], -1, steps.shape[2], -1)
        hidden = evicted_by.gather(-1, index)  # [L, B, H, N]
        share = 1.0 - hidden / (queries + 1)[None, :, None, :]
        weights = completion_mask[None, :, None, :].to(share.dtype).expand_as(share)
        if weights.sum() == 0:
            return torch.tensor(1.0)
        return (share * weights).sum() / weights.sum()

    def visible_fraction_by_phase(
        self, prompt_lengths: torch.Tensor, completion_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Visible share of the keys per rollout phase, averaged over layers, KV heads and rows.

        * ``"prompt"``: share of each prompt's keys kept by the prefill (those with ``evict_steps > P``, i.e.
          visible to the first decode query; later evictions are the decode phase's).
        * ``"decode"``: `visible_fraction` over the completion tokens sampled by decode queries (all but the first,
          which the dense prefill samples).

        Args:
            prompt_lengths: ``[B]`` real prompt lengths.
            completion_mask: ``[B, N]`` True on real completion tokens.

        Returns:
            ``{"prompt": 0-d tensor, "decode": 0-d tensor}``, each in [0, 1].
        """
        columns = torch.arange(self.length, device=self.evict_steps.device)
        in_prompt = columns[None, :] < prompt_lengths[:, None]  # [B, T]
        limit = prompt_lengths.to(self.evict_steps.dtype)[None, :, None, None]  # int32 compare: no int64 copy
        kept = (self.evict_steps > limit) & in_prompt[None, :, None, :]
        prompt = (kept.sum(-1).double() / prompt_lengths[None, :, None].double()).mean()
        decode_mask = completion_mask.clone()
        decode_mask[:, :1] = False
        return {"prompt": prompt, "decode": self.visible_fraction(prompt_lengths, decode_mask)}


@dataclass
class AttentionPlan:
    """How the registered attention function masks one teacher-forced forward pass, one row per sample.

    Built by `lit_smd.learner` for a right-padded batch whose column index is the logical position.

    Attributes:
        lengths: ``[B]`` real tokens per row (prompt + completion); later columns are padding.
        shadow: The rollout's eviction record, or None for the dense (causal + padding) view.
        backend: ``"sdpa"`` (boolean mask, any device), ``"flex"`` (FlexAttention BlockMask, CUDA) or
            ``"auto"`` (flex on CUDA, sdpa elsewhere).
        capture_prompt_width: With ``W > 0``, keep each layer's keys / values of columns ``[0, W)`` (detached copies)
            in ``prompt_kv``, for a later pass over the completions only (SMD's dense teacher, `lit_smd.learner`).
        prompt_kv: Layer index -> ``(keys [B, H_kv, W, D], values)``, filled by a capturing pass.
        prompt_lengths: ``[B]`` prompt tokens per row. On FlexAttention the shadow view then reorders each row's
            completion keys by eviction step (`lit_smd.kv.flex_sorted`), so that its blocks skip evicted keys;
            without it the keys keep their order (blocks classified by `lit_smd.kv.flex.row_block_mask`).
    """

    lengths: torch.Tensor
    shadow: ShadowMask | None = None
    backend: Backend = "auto"
    capture_prompt_width: int = 0
    prompt_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    prompt_lengths: torch.Tensor | None = None
    _block_masks: dict[int | None, object] = field(default_factory=dict, repr=False)

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
        dropout: float, sliding_window: int | None, features: AttentionFeatures = PLAIN,
    ) -> torch.Tensor:
        """Attention output ``[B, T, H_q, D]`` for ``query [B, H_q, T, D]``, ``key / value [B, H_kv, T, D]``.

        ``features`` (softcap, sinks; `lit_smd.kv.features`) apply on both backends.
        """
        width = query.shape[2]
        if self.capture_prompt_width and layer_idx not in self.prompt_kv:  # not again in a checkpointed recompute
            # Copies, not views: a view would keep the whole row's keys alive with the plan.
            prompt = slice(0, self.capture_prompt_width)
            self.prompt_kv[layer_idx] = (key[:, :, prompt].detach().clone(), value[:, :, prompt].detach().clone())
        if use_flex(self.backend, query.device, dropout):
            sortable = features.sinks is None and (sliding_window is None or sliding_window >= width)
            if self.shadow is not None and self.prompt_lengths is not None and sortable:
                steps = self.shadow.evict_steps[layer_idx]  # [B, Hrec, >= T]
                keys = row_sorted_keys(self.lengths, self.prompt_lengths, steps, query.shape[1], width)
                return sorted_attention(query, key, value, keys, scaling, features).transpose(1, 2).contiguous()
            block_mask = self.block_mask(layer_idx, query.shape[1], width, sliding_window)
            out = flex_feature_attention(query, key, value, block_mask, scaling, features)  # [B, Hq, T, D]
            return out.transpose(1, 2).contiguous()
        steps = None if self.shadow is None else self.shadow.evict_steps[layer_idx, :, :, :width]  # [B, Hkv, T]
        out = causal_rows_attention(
            query, key, value, self.lengths, steps, scaling, sliding_window, features, dropout=dropout
        )  # [B, Hq, T, D]
        return out.transpose(1, 2).contiguous()

    def real_tokens(self, length: int) -> torch.Tensor:
        """``[B, length]`` bool: each row's columns before its ``lengths`` (the later ones are padding;
        `lit_smd.kv.real_tokens`)."""
        return torch.arange(length, device=self.lengths.device)[None, :] < self.lengths[:, None]

    def block_mask(self, layer_idx: int, num_heads: int, width: int, sliding_window: int | None):
        """FlexAttention BlockMask for one layer (`lit_smd.kv.flex.row_block_mask`): the dense view's, the same for
        every layer, built once per plan and window; the shadow view's, within its blocks, per call and not kept."""
        if sliding_window not in self._block_masks:
            self._block_masks[sliding_window] = row_block_mask(self.lengths, None, num_heads, width, sliding_window)
        dense = self._block_masks[sliding_window]
        if self.shadow is None:
            return dense
        steps = self.shadow.evict_steps[layer_idx]  # [B, Hkv, >= T]
        return row_block_mask(self.lengths, steps, num_heads, width, sliding_window, dense=dense)
