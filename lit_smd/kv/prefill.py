"""Prompt attention of the rollout's prefill, and the prompt scores compressors read from it, in O(P) memory.

The prefill runs dense causal attention over each left-padded prompt. Prefill policies need two statistics of its
softmax probabilities ``p[i, j]`` (query ``i``, key ``j``, per query head):

* SnapKV (Li et al. 2024, arXiv 2404.14469): the rows of the last ``window`` prompt queries (``window x P``);
* H2O (Zhang et al. 2023, arXiv 2306.14048): the column sums ``sum_i p[i, j]`` over every real prompt query and
  the query heads of each GQA group (the heavy-hitter initialisation), which need every row's normaliser.

`blockwise_attention` computes the attention output and both statistics in one pass over *row strips*: query rows
``[s, s + block)`` against the keys they can see (``[0, s + block)``, or the sliding window), one matmul for the
scores, one row-wise softmax in place, one matmul with the values and one matrix-vector product for the column sums.
Holding a whole strip row means its normaliser is exact without the online rescaling of FlashAttention (Dao et al.
2022, arXiv 2205.14135), so the probabilities are computed once and shared by the output, the column sums and
SnapKV's window rows. Masks are built per strip and only where some key is invisible (the diagonal block, pad
columns, the sliding window's edge): nothing of size ``P x P`` is ever allocated. A strip is ``head_dim`` query rows
high (at least `MIN_BLOCK_ROWS`), so a strip holds as many scores as the layer's query tensor has elements
(float32/64): the prefill's peak grows by a buffer of the query's size, not with ``P^2``.

When a compressor needs no column sums, the output comes from SDPA (``is_causal``; one call per prompt when prompts
are left-padded, on the unpadded slice) and SnapKV's window rows from a strip pass over the last ``window`` queries
only. Pad query rows attend to themselves inside the kernel (no NaN) and are then zeroed: their output is zero
and they add nothing to any score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lit_smd.kv.features import PLAIN, AttentionFeatures, softmax_dtype

__all__ = ["MIN_BLOCK_ROWS", "PrefillContext", "PromptAttention", "blockwise_attention"]

MIN_BLOCK_ROWS = 16
"""Smallest default strip height (query rows per strip; the default is ``max(head_dim, MIN_BLOCK_ROWS)``)."""


class PromptAttention(NamedTuple):
    """Results of `blockwise_attention`; fields not asked for are None.

    Attributes:
        output: ``[B, R, H_q, D_v]`` attention output of the query rows ``[first_row, P)``, in the query's dtype.
        window: ``[B, H_kv, G, W, P]`` softmax probabilities of the last ``W`` prompt queries (float32/64).
        column_sums: ``[B, H_kv, P]`` probability each key received, summed over the real query rows
            ``[first_row, P)`` and the ``G`` query heads of its group (float32/64).
    """

    output: torch.Tensor | None
    window: torch.Tensor | None
    column_sums: torch.Tensor | None


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    scaling: float,
    pad_left: torch.Tensor,
    sliding_window: int | None,
    *,
    first_row: int = 0,
    window_rows: int = 0,
    column_sums: bool = False,
    block_rows: int | None = None,
    features: AttentionFeatures = PLAIN,
) -> PromptAttention:
    """Causal prompt attention over left-padded rows, strip by strip (see the module docstring).

    Query ``i`` sees key ``j`` iff ``pad_left[b] <= j <= i`` and, with a sliding window, ``i - j < sliding_window``.

    Args:
        query: ``[B, H_q, P, D]`` post-RoPE queries.
        key: ``[B, H_kv, P, D]`` post-RoPE keys (``H_q`` a multiple of ``H_kv``; query head ``q`` reads ``q // G``).
        value: ``[B, H_kv, P, D_v]`` (``D_v`` may differ from ``D``, as in MLA), or None when no output is needed.
        scaling: Softmax scaling.
        pad_left: ``[B]`` left pads of each row.
        sliding_window: The layer's sliding window, or None.
        first_row: Only query rows ``[first_row, P)`` are computed.
        window_rows: Return the probabilities of the last ``window_rows`` queries (0 = none); they must lie in
            ``[first_row, P)``.
        column_sums: Return the column sums of the probabilities of rows ``[first_row, P)``.
        block_rows: Query rows per strip (default ``max(D, MIN_BLOCK_ROWS)``: a strip's scores are no larger than
            the query tensor).
        features: The layer's softcap and attention sinks (`lit_smd.kv.features`); the probabilities returned are
            the model's (a sink's share of each row is dropped, as transformers drops its column).

    Returns:
        A `PromptAttention`.
    """
    batch, q_heads, width, dim = query.shape
    kv_heads = key.shape[1]
    group, heads = q_heads // kv_heads, batch * kv_heads
    dtype = softmax_dtype(query.dtype)
    rows = width - first_row
    if not 0 <= window_rows <= rows:
        raise ValueError(f"window_rows must be in [0, {rows}] (the computed query rows), got {window_rows}")
    q = (query[:, :, first_row:].to(dtype) * scaling).view(batch, kv_heads, group, rows, dim)
    q = q.transpose(2, 3).reshape(heads, rows * group, dim)  # strip rows ordered (query, head of the group)
    k = key.to(dtype).reshape(heads, width, dim)
    value_dim = dim if value is None else value.shape[-1]
    v = None if value is None else value.to(dtype).reshape(heads, width, value_dim)
    out = None if v is None else q.new_zeros(heads, rows * group, value_dim)
    sums = q.new_zeros(heads, 1, width) if column_sums else None
    win = q.new_zeros(heads, window_rows, group, width) if window_rows else None
    win_start = width - window_rows
    step = max(dim, MIN_BLOCK_ROWS) if block_rows is None else block_rows
    buffer = q.new_empty(heads * min(step, rows) * group * width)  # reused by every strip: no per-strip allocation
    columns = torch.arange(width, device=query.device)
    pad_lo, pad_hi = int(pad_left.min()), int(pad_left.max())
    ones = q.new_ones(heads, 1, step * group)
    sink_rows = None
    if features.sinks is not None:  # strip row r * G + g of (batch, KV head) h reads query head h_kv * G + g
        sinks = features.sinks.to(dtype).view(1, kv_heads, 1, group)
        sink_rows = sinks.expand(batch, kv_heads, step, group).reshape(heads, step * group, 1)
    for start in range(first_row, width, step):
        end = min(width, start + step)
        if end <= pad_lo:  # every row of the strip is a pad (zero output)
            continue
        low = min(pad_lo, start)  # columns before pad_lo are pads for every row
        if sliding_window is not None:
            low = max(low, start - sliding_window + 1)
        span, strip = end - low, (end - start) * group
        scores = buffer[: heads * strip * span].view(heads, strip, span)
        torch.bmm(q[:, (start - first_row) * group : (end - first_row) * group], k[:, low:end].transpose(1, 2),
                  out=scores)
        features.cap(scores)
        by_row = scores.view(batch, kv_heads, end - start, group, span)
        edge = max(pad_hi, low if sliding_window is None else end - sliding_window)
        q_cols = columns[start:end, None]  # [R, 1]
        for lo, hi in ((low, min(start, edge)), (max(start, low), end)):  # column ranges where some key is invisible
            if hi <= lo:
                continue
            k_cols = columns[None, lo:hi]
            visible = (k_cols <= q_cols)[None] & (k_cols >= pad_left[:, None, None])  # [B, R, K]
            if sliding_window is not None:
                visible &= (k_cols > q_cols - sliding_window)[None]
            visible |= (k_cols == q_cols)[None]  # pad rows see themselves (no NaN); zeroed below
            by_row[..., lo - low : hi - low].masked_fill_(~visible[:, None, :, None, :], float("-inf"))
        if sink_rows is not None:  # the sink column joins the normaliser, in place
            log_norm = torch.logaddexp(scores.logsumexp(dim=-1, keepdim=True), sink_rows[:, :strip])
            scores.sub_(log_norm).exp_()
        elif scores.device.type == "cpu":  # row-wise fused softmax, in place: the strip is never copied
            torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        else:
            scores = torch.softmax(scores, dim=-1)
        if out is not None:
            out[:, (start - first_row) * group : (end - first_row) * group] = torch.bmm(scores, v[:, low:end])
        if sums is not None:
            sums[:, :, low:end].baddbmm_(ones[:, :, :strip], scores)
        if win is not None and end > win_start:
            first = max(start, win_start)
            probs = scores.view(heads, end - start, group, span)[:, first - start :]
            win[:, first - win_start : end - win_start, :, low:end] = probs
    pad_rows = columns[None, first_row:] < pad_left[:, None]  # [B, R]: they saw only themselves
    output = window = None
    if out is not None:
        output = out.view(batch, kv_heads, rows, group, value_dim).permute(0, 2, 1, 3, 4)
        output = output.reshape(batch, rows, q_heads, value_dim)
        output = output.masked_fill(pad_rows[:, :, None, None], 0.0).to(query.dtype)
    if win is not None:
        window = win.view(batch, kv_heads, window_rows, group, width).transpose(2, 3)
        window = window.masked_fill(pad_rows[:, None, None, rows - window_rows :, None], 0.0)
    if sums is not None:  # a pad row's mass sits on its own (pad) column, which no real row sees
        sums = sums.view(batch, kv_heads, width).masked_fill((columns[None, :] < pad_left[:, None])[:, None], 0.0)
    return PromptAttention(output, window, sums)


def causal_prompt_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    pad_left: torch.Tensor,
    sliding_window: int | None,
    features: AttentionFeatures = PLAIN,
) -> torch.Tensor:
    """Attention output only, ``[B, P, H_q, D_v]``: SDPA where a causal kernel applies, else `blockwise_attention`
    (sliding windows, softcap, sinks)."""
    width = query.shape[2]
    if (sliding_window is not None and sliding_window < width) or not features.plain:
        return blockwise_attention(query, key, value, scaling, pad_left, sliding_window, features=features).output
    if not bool(pad_left.any()):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)
    out = query.new_zeros(query.shape[0], width, query.shape[1], value.shape[3])
    for row, pads in enumerate(pad_left.tolist()):  # one causal call per prompt on its unpadded slice
        part = F.scaled_dot_product_attention(
            query[row : row + 1, :, pads:], key[row : row + 1, :, pads:], value[row : row + 1, :, pads:],
            is_causal=True, scale=scaling, enable_gqa=True,
        )
        out[row, pads:] = part[0].transpose(0, 1)
    return out


@dataclass
class PrefillContext:
    """What a prefill compressor may look at: the exact dense prefill attention of one layer, in O(P) memory.

    `attend` computes the layer's prompt attention output; when told that the compressor needs the column sums (or
    SnapKV's window rows), it computes them in the same pass. Asked for later, they are computed on demand.

    Attributes:
        query: ``[B, H_q, P, D]`` post-RoPE queries of the prompt batch (left-padded).
        key: ``[B, H_kv, P, D]`` post-RoPE keys.
        value: ``[B, H_kv, P, D_v]`` values.
        scaling: Softmax scaling of the attention module.
        positions: ``[B, P]`` logical positions of the columns (``-1`` for pads).
        newest: ``[B]`` logical position of each sequence's last prompt token.
        sliding_window: The layer's sliding window, or None.
        generator: Generator for randomised policies (the rollout's; None = torch's default generator).
        features: The layer's softcap and attention sinks: every probability computed here is the model's.
        cache_heads: Heads the cache keeps and evicts by (None = ``H_kv``). MLA caches one latent head that the
            model expands to ``H_kv`` key heads: the statistics of the ``H_kv / cache_heads`` key heads of a cache
            head are then pooled as a GQA group's query heads are (SnapKV's mean, H2O's sum).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float
    positions: torch.Tensor
    newest: torch.Tensor
    sliding_window: int | None
    generator: torch.Generator | None
    features: AttentionFeatures = field(default_factory=AttentionFeatures)
    cache_heads: int | None = None
    _window: torch.Tensor | None = field(default=None, init=False, repr=False)
    _column_sums: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        key_heads = self.key.shape[1]
        if self.cache_heads is None:
            self.cache_heads = key_heads
        elif self.cache_heads < 1 or key_heads % self.cache_heads:
            raise ValueError(f"cache_heads must divide the {key_heads} key heads, got {self.cache_heads}")

    @property
    def num_kv_heads(self) -> int:
        """Heads the compressor scores and the cache evicts by (`cache_heads`)."""
        return self.cache_heads

    @property
    def pad_left(self) -> torch.Tensor:
        return (self.positions < 0).sum(dim=1)

    def attend(self, *, column_sums: bool = False, window: int = 0) -> torch.Tensor:
        """The prompt attention output ``[B, P, H_q, D]``; with ``column_sums``, also the scores of the same pass.

        Args:
            column_sums: Compute `attention_column_sums` in the same pass (then ``window`` rows are kept too).
            window: SnapKV observation window to keep from that pass (0 = none).
        """
        if not column_sums:
            return causal_prompt_attention(
                self.query, self.key, self.value, self.scaling, self.pad_left, self.sliding_window, self.features
            )
        result = blockwise_attention(
            self.query, self.key, self.value, self.scaling, self.pad_left, self.sliding_window,
            window_rows=min(window, self.query.shape[2]), column_sums=True, features=self.features,
        )
        self._window, self._column_sums = result.window, result.column_sums
        return result.output

    def window_attention(self, window: int) -> torch.Tensor:
        """Attention of the last ``window`` prompt queries: ``[B, H_c, H_q / H_c, window, P]`` (float32/64), by
        cache head ``H_c`` (`num_kv_heads`)."""
        if self._window is None or self._window.shape[3] < window:
            self._window = blockwise_attention(
                self.query, self.key, None, self.scaling, self.pad_left, self.sliding_window,
                first_row=self.query.shape[2] - window, window_rows=window, features=self.features,
            ).window
        probs = self._window[:, :, :, self._window.shape[3] - window :]  # [B, H_kv, G, window, P]
        return probs.reshape(probs.shape[0], self.cache_heads, -1, *probs.shape[3:])

    def attention_column_sums(self) -> torch.Tensor:
        """Attention each prompt key received, summed over real prompt queries and the query heads of each cache
        head: ``[B, H_c, P]``."""
        if self._column_sums is None:
            self._column_sums = blockwise_attention(
                self.query, self.key, None, self.scaling, self.pad_left, self.sliding_window, column_sums=True,
                features=self.features,
            ).column_sums
        sums = self._column_sums  # [B, H_kv, P]
        if self.cache_heads == sums.shape[1]:
            return sums
        return sums.view(sums.shape[0], self.cache_heads, -1, sums.shape[-1]).sum(dim=2)
