"""The FlexAttention learner path (CUDA's default) agrees with the SDPA path and compiles a bounded number of times.

The mask_mods are checked uncompiled against the SDPA visibility over their bucketed grid (fast). The compiled path
(`lit_smd.kv.flex`) runs forward only on the CPU (torch 2.13 has no FlexAttention backward there) and compiles for
about a minute per graph on 2 cores, so those tests are marked slow; `benchmarks/gpu_check.sh` runs forward and
backward on a GPU.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from lit_smd.kv import flex
from lit_smd.kv.flex import FlexRecompileLimitError, bucket, flex_compilations, row_mask_mod
from lit_smd.kv.packed import PackedPlan
from lit_smd.kv.shadow import AttentionPlan, ShadowMask
from lit_smd.learner import dense_hidden_states, learner_hidden_states, score
from lit_smd.rollout import generate

from .conftest import make_compressor
from .test_shadow_replay import _prompts


def test_buckets_bound_the_padding_and_the_number_of_shapes():
    sizes = range(1, 40_000)
    buckets = [bucket(size) for size in sizes]
    assert all(b >= s for b, s in zip(buckets, sizes, strict=True))
    assert all(b <= max(128, 1.25 * s) for b, s in zip(buckets, sizes, strict=True))
    assert buckets == sorted(buckets)
    assert len({bucket(size) for size in range(1024, 32_769)}) == 21  # four per doubling, 1k-32k


def _plan(rows: int, width: int, kv_heads: int, *, shadow: bool, seed: int = 0, sort: bool = False) -> AttentionPlan:
    """A per-row flex plan; with ``sort`` it knows the prompt lengths, so its shadow view reorders the completion
    keys (`lit_smd.kv.flex_sorted`), as the learner's does."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    lengths[0] = width
    steps = None
    if shadow:  # eviction steps anywhere from the key itself to past the end (never evicted)
        keys = torch.arange(width)
        steps = keys + torch.randint(1, width, (1, rows, kv_heads, width), generator=g)
        steps = ShadowMask(steps.to(torch.int32))
    prompt_lengths = lengths // 3 if sort else None
    return AttentionPlan(lengths=lengths, shadow=steps, backend="flex", prompt_lengths=prompt_lengths)


def _naive_visible(plan: AttentionPlan, layer: int, width: int, window: int | None) -> torch.Tensor:
    """Boolean visibility ``[B, H_kv or 1, T, T]`` of one layer, from the shadow-mask contract."""
    positions = torch.arange(width)
    query, key = positions[:, None], positions[None, :]
    visible = (key <= query) & (key < plan.lengths[:, None, None])  # [B, T, T]
    if window is not None:
        visible &= (query - key) < window
    visible = visible[:, None]  # [B, 1, T, T]
    if plan.shadow is not None:
        visible = visible & (query < plan.shadow.evict_steps[layer, :, :, None, :width])  # [B, Hkv, T, T]
    return visible | torch.eye(width, dtype=torch.bool)  # padding rows see themselves


@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_row_mask_mod_matches_the_sdpa_visibility(shadow, window):
    """Over the bucketed grid (rows 3 -> 4, width 150 -> 160) the real part is the contract's visibility, the rest
    sees nothing."""
    rows, width, heads, kv_heads = 3, 150, 4, 2
    plan = _plan(rows, width, kv_heads, shadow=shadow)
    steps = plan.shadow.evict_steps[0] if shadow else None
    mask_mod, padded_rows, size = row_mask_mod(plan.lengths, steps, width, window, heads // kv_heads)
    assert (padded_rows, size) == (4, 160)
    grid = create_mask(mask_mod, padded_rows, heads, size, size, device="cpu")  # [4, Hq, 160, 160]
    visible = _naive_visible(plan, 0, width, window)  # [B, Hkv or 1, T, T]
    visible = visible.repeat_interleave(heads // visible.shape[1], dim=1)
    assert torch.equal(grid[:rows, :, :width, :width], visible)
    assert not grid[rows:].any() and not grid[:, :, width:].any() and not grid[..., width:].any()


def _covered(block_mask) -> torch.Tensor:
    """``[rows, 1, size, size]``: the positions inside the blocks ``block_mask`` computes (partial or full)."""
    size = block_mask.BLOCK_SIZE[0]
    return block_mask.to_dense().bool().repeat_interleave(size, 2).repeat_interleave(size, 3)


@pytest.fixture
def uncompiled_block_masks(monkeypatch):
    """The dense view's ``create_block_mask`` uncompiled (seconds instead of a compilation, same result)."""
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(flex, "_block_mask", lambda mask_mod, rows, size, device: create_block_mask(
        mask_mod, rows, 1, size, size, device=device))  # fmt: skip


NEVER = torch.iinfo(torch.int32).max


def _pattern(name: str, logical: torch.Tensor, kv_heads: int, prompt: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``[rows, H_kv, T]`` int32 eviction steps over keys at logical positions ``logical [rows, T]``: ``recent``
    (4 sinks, each other key evicted 40 positions after it), ``prefill`` (half the prompt keys dropped per head when
    the prompt ``[rows]`` ends, nothing later), ``h2o`` (half the keys 40 positions after the key, the rest never;
    prompt keys at least to its end), ``random`` (anywhere after the key)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = logical.shape
    logical = logical[:, None].expand(rows, kv_heads, width).long()
    end = prompt[:, None, None].expand_as(logical)
    if name == "recent":
        steps = torch.where(logical < 4, NEVER, logical + 40)
    elif name == "prefill":
        dropped = (torch.rand(rows, kv_heads, width, generator=g) < 0.5) & (logical < end - 8)
        steps = torch.where(dropped, end, NEVER)
    elif name == "h2o":
        young = torch.rand(rows, kv_heads, width, generator=g) < 0.5
        steps = torch.maximum(torch.where(young, logical + 40, NEVER), end)
    else:
        steps = logical + torch.randint(1, 2 * width, (rows, kv_heads, width), generator=g)
    return steps.to(torch.int32)


def _block_counts(block_mask, mask_mod, rows: int, heads: int, size: int) -> tuple[int, int]:
    """Check a shadow view's BlockMask against its ``mask_mod`` on every head and position: every visible position
    lies in a computed block, every position of a full block is visible. Returns (computed blocks, full blocks)."""
    visible = create_mask(mask_mod, rows, heads, size, size, device="cpu")  # [rows, Hq, size, size]
    side = block_mask.BLOCK_SIZE[0]
    partial = flex._blocks_of(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.kv_indices)
    full = flex._blocks_of(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, block_mask.kv_indices)

    def positions(blocks: torch.Tensor) -> torch.Tensor:  # [rows, 1, QB, KB] -> [rows, 1, size, size]
        return blocks.repeat_interleave(side, 2).repeat_interleave(side, 3)[..., :size, :size]

    assert not (partial & full).any()
    assert not (visible & ~positions(partial | full)).any()  # nothing visible is skipped
    assert visible[positions(full).expand_as(visible)].all()  # no mask is needed where none is applied
    return int((partial | full).sum()), int(full.sum())


def _aligned_steps(rows: int, kv_heads: int, keys: int, base: torch.Tensor, seed: int) -> torch.Tensor:
    """``[rows, H_kv, keys]`` eviction steps, one per 128-key block and head: key block ``j``'s keys leave at
    ``base + 128 (j + 1 + r) + o``, ``r`` in 0..2 per head and ``o`` in (0, 1, 127, 128): the first or second
    query, or the last or the one after it, of a later query block whose first position is
    ``base + 128 (j + 1 + r)``."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-keys // 128)
    later = torch.randint(0, 3, (rows, kv_heads, blocks), generator=g)  # per head; the offset the same on each
    offset = torch.tensor([0, 1, 127, 128])[torch.randint(0, 4, (rows, 1, blocks), generator=g)]
    steps = base[:, None, None] + 128 * (torch.arange(blocks) + 1 + later) + offset
    return steps.repeat_interleave(128, dim=-1)[..., :keys].to(torch.int32)


def _exact_blocks(block_mask, mask_mod, rows: int, heads: int, size: int) -> int:
    """The BlockMask computes exactly the blocks with a visible position on some head, and marks full exactly those
    visible everywhere on every head (some, at least). Returns the number of blocks computed."""
    visible = create_mask(mask_mod, rows, heads, size, size, device="cpu")  # [rows, Hq, size, size]
    tiles = visible.unflatten(2, (-1, 128)).unflatten(4, (-1, 128))  # [rows, Hq, QB, 128, KB, 128]
    needed = tiles.any(5).any(3).any(1, keepdim=True)  # [rows, 1, QB, KB]
    whole = tiles.all(5).all(3).all(1, keepdim=True)
    partial = flex._blocks_of(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.kv_indices)
    full = flex._blocks_of(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, block_mask.kv_indices)
    assert torch.equal(partial | full, needed) and torch.equal(full, whole)
    assert full.any()
    return int(needed.sum())


def test_shadow_block_mask_is_exact_for_block_aligned_evictions(uncompiled_block_masks):
    """Evictions at and around query-block boundaries, one step per key block: the per-row and packed BlockMasks
    compute exactly the blocks some head sees into, full exactly where every head sees everything (off by one
    position either way, a block would be skipped with a visible key, or computed unmasked with a hidden one)."""
    heads, kv_heads = 4, 2
    width = 640
    lengths = torch.full((2,), width)
    steps = _aligned_steps(2, kv_heads, width, torch.zeros(2, dtype=torch.long), seed=0)
    dense = flex.row_block_mask(lengths, None, heads, width, None)
    block_mask = flex.row_block_mask(lengths, steps, heads, width, None, dense=dense)
    mask_mod, rows, size = row_mask_mod(lengths, steps, width, None, heads // kv_heads)
    assert _exact_blocks(block_mask, mask_mod, rows, heads, size) < size // 128 * (size // 128 + 1)  # skips

    prompt_width, slots, new = 256, 2, 512
    prompt_lengths = torch.tensor([256, 200])
    per_slot = []
    for slot in range(slots):  # prompt keys: the slot's query blocks start at P + 128 r; own keys as above
        prompt = _aligned_steps(2, kv_heads, prompt_width, prompt_lengths - 128, seed=10 + slot)
        own = _aligned_steps(2, kv_heads, new, prompt_lengths, seed=20 + slot)
        per_slot.append(torch.cat([prompt, own], dim=-1))
    steps = torch.stack(per_slot, dim=2)  # [R, Hkv, S, W + N]
    layout = (prompt_lengths, prompt_width, slots, new)
    dense = flex.packed_block_mask(*layout, None, heads, None)
    block_mask = flex.packed_block_mask(*layout, steps, heads, None, dense=dense)
    mask_mod, rows, size = flex.packed_mask_mod(*layout, steps, None, heads // kv_heads)
    assert _exact_blocks(block_mask, mask_mod, rows, heads, size) < size // 128 * (size // 128 + 1)  # skips


@pytest.mark.parametrize("pattern", ["recent", "prefill", "random"])
@pytest.mark.parametrize("window", [None, 100])
def test_shadow_block_mask_per_row_skips_evicted_blocks_and_keeps_every_visible_one(
    uncompiled_block_masks, pattern, window
):
    """The shadow view's BlockMask computes the dense view's blocks less those the evictions empty on every head,
    with no mask where no eviction touches a full block: exact against the ``mask_mod`` on every position."""
    rows, width, heads, kv_heads = 3, 600, 4, 2
    lengths = torch.tensor([width, width - 77, width // 2])
    steps = _pattern(pattern, torch.arange(width).expand(rows, -1), kv_heads, torch.full((rows,), 200))
    steps = steps.masked_fill(torch.arange(width) >= lengths[:, None, None], 0)  # padding: a query sees only itself
    dense = flex.row_block_mask(lengths, None, heads, width, window)
    block_mask = flex.row_block_mask(lengths, steps, heads, width, window, dense=dense)
    mask_mod, padded_rows, size = row_mask_mod(lengths, steps, width, window, heads // kv_heads)
    computed, full = _block_counts(block_mask, mask_mod, padded_rows, heads, size)
    assert block_mask.mask_mod is not dense.mask_mod and computed <= int(dense.to_dense().sum())
    upper = torch.ones(size // 128, size // 128, dtype=torch.bool).triu(1)
    assert not block_mask.to_dense()[..., upper].any()
    if window is not None:  # query block 4 and key block 0 are over 100 positions apart: skipped
        assert not block_mask.to_dense()[:, :, 4, 0].any()
    if pattern == "recent" and window is None:  # keys 4..127 are gone by query 168: key block 0 is partial there,
        assert computed < int(dense.to_dense().sum())  # key blocks 1..2 empty for query block 4
    if pattern == "prefill" and window is None:  # no completion key is evicted: whole blocks below the diagonal
        assert full > 0


@pytest.mark.parametrize("pattern", ["recent", "prefill", "random", "by_slot"])
@pytest.mark.parametrize(
    ("prompt_width", "prompt_lengths", "num_slots", "slot_width"),
    [(200, (200, 150), 2, 300), (128, (120, 128), 5, 50), (64, (10, 64), 3, 200)],
)  # the second: query blocks spanning three slots
def test_shadow_block_mask_packed_skips_evicted_blocks_and_keeps_every_visible_one(
    uncompiled_block_masks, pattern, prompt_width, prompt_lengths, num_slots, slot_width
):
    heads, kv_heads = 4, 2
    prompt_lengths = torch.tensor(prompt_lengths)
    columns = torch.arange(prompt_width + slot_width)
    logical = torch.where(columns < prompt_width, columns, prompt_lengths[:, None] + columns - prompt_width)
    if pattern == "by_slot":  # the whole prompt evicted when it ends, but in slot 1
        in_prompt = (columns < prompt_width).expand(len(prompt_lengths), kv_heads, -1)
        evicted = torch.where(in_prompt, prompt_lengths[:, None, None], NEVER)
        per_slot = [torch.full_like(evicted, NEVER) if slot == 1 else evicted for slot in range(num_slots)]
    else:
        per_slot = [_pattern(pattern, logical, kv_heads, prompt_lengths, seed=slot) for slot in range(num_slots)]
    steps = torch.stack(per_slot, dim=2).to(torch.int32)  # [R, Hkv, S, W + N]
    layout = (prompt_lengths, prompt_width, num_slots, slot_width)
    dense = flex.packed_block_mask(*layout, None, heads, None)
    block_mask = flex.packed_block_mask(*layout, steps, heads, None, dense=dense)
    mask_mod, padded_rows, size = flex.packed_mask_mod(*layout, steps, None, heads // kv_heads)
    computed, _ = _block_counts(block_mask, mask_mod, padded_rows, heads, size)
    assert computed <= int(dense.to_dense().sum())
    if pattern == "recent" and num_slots == 2:
        assert computed < int(dense.to_dense().sum())


def _slot_padding(layout, slot_lengths: torch.Tensor, rows: int, size: int) -> torch.Tensor:
    """``[rows, size]`` bool: the packed columns that are a slot's padding (offset at or past its length)."""
    prompt_lengths, width, slots, new = layout
    columns = torch.arange(size)
    slot, offset = (columns - width) // new, (columns - width) % new
    in_slots = (columns >= width) & (columns < width + slots * new)
    tokens = torch.zeros(rows, slots, dtype=torch.long)
    tokens[: len(slot_lengths)] = slot_lengths
    return in_slots & (offset >= tokens.gather(1, slot.clamp(0, slots - 1).expand(rows, -1)))


@pytest.mark.parametrize("pattern", [None, "recent", "h2o"])
def test_packed_block_masks_skip_a_slots_padding(uncompiled_block_masks, pattern):
    """With the slots' lengths a slot's padding queries see only themselves (every other query sees what it did),
    and both views' BlockMasks (the shadow view's in key order) compute fewer blocks, each still holding every
    visible position."""
    heads, kv_heads = 4, 2
    layout = (torch.tensor([200, 150]), 200, 3, 600)  # prompt lengths, W, S, N
    slot_lengths = torch.tensor([[600, 130, 0], [300, 600, 257]])  # [R, S]: full, cut, empty slots
    prompt_lengths, width, slots, new = layout
    steps = None
    if pattern is not None:
        columns = torch.arange(width + new)
        logical = torch.where(columns < width, columns, prompt_lengths[:, None] + columns - width)
        steps = torch.stack([_pattern(pattern, logical, kv_heads, prompt_lengths, seed=s) for s in range(slots)], 2)
    group = heads // kv_heads
    counts = {}
    for lengths in (None, slot_lengths):
        dense = flex.packed_block_mask(*layout, None, heads, None, slot_lengths=lengths)
        block_mask = dense
        if steps is not None:
            block_mask = flex.packed_block_mask(*layout, steps, heads, None, dense=dense, slot_lengths=lengths)
        mask_mod, rows, size = flex.packed_mask_mod(*layout, steps, None, group, lengths)
        counts[lengths is None] = _block_counts(block_mask, mask_mod, rows, heads, size)[0]
        counts[lengths is None, "visible"] = create_mask(mask_mod, rows, heads, size, size, device="cpu")
    padding = _slot_padding(layout, slot_lengths, rows, size)  # [rows, size]
    visible, before = counts[False, "visible"], counts[True, "visible"]  # [rows, Hq, size, size]
    assert padding.sum() == 470 + 600 + 300 + 343
    assert torch.equal(visible.transpose(1, 2)[~padding], before.transpose(1, 2)[~padding])
    only_itself = torch.eye(size, dtype=torch.bool)[None, None].expand_as(visible).transpose(1, 2)[padding]
    assert torch.equal(visible.transpose(1, 2)[padding], only_itself)
    assert counts[False] < 0.75 * counts[True]


def test_shadow_block_mask_holds_every_visible_position_packed(peaky_model_factory, uncompiled_block_masks):
    from tests.test_learner import _rollout

    model = peaky_model_factory("qwen3")
    rollout = _rollout(model, lengths=(300, 260))
    plan = learner_hidden_states(model, rollout, shadow=True, backend="sdpa")._packing.plan
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    layout = (plan.prompt_lengths, plan.prompt_width, plan.num_slots, plan.slot_width)
    dense = flex.packed_block_mask(*layout, None, heads, None)
    for layer in range(model.config.num_hidden_layers):
        block_mask = flex.packed_block_mask(*layout, plan.steps[layer], heads, None, dense=dense)
        mask_mod, padded_rows, size = flex.packed_mask_mod(*layout, plan.steps[layer], None, heads // kv_heads)
        visible = create_mask(mask_mod, padded_rows, heads, size, size, device="cpu")
        assert size >= 384
        assert not (visible & ~_covered(block_mask)).any()


@pytest.mark.slow
def test_compiled_flex_matches_sdpa_in_both_layouts(peaky_model_factory):
    """Per row and shared prefix, shadow and dense view: compiled FlexAttention against SDPA (float32, forward)."""
    from tests.test_learner import _rollout

    model = peaky_model_factory("qwen3", dtype=torch.float32)
    rollout = _rollout(model)
    mask = rollout.completion_mask[..., None]
    for layout in ("per_row", "shared_prefix"):
        for shadow in (True, False):
            with torch.no_grad():
                flex_out = learner_hidden_states(model, rollout, shadow=shadow, layout=layout, backend="flex").hidden
                sdpa_out = learner_hidden_states(model, rollout, shadow=shadow, layout=layout, backend="sdpa").hidden
            assert ((flex_out - sdpa_out) * mask).abs().max() <= 1e-5, (layout, shadow)


@pytest.mark.slow
@pytest.mark.parametrize("prompts", [(40, 31), (150, 140)], ids=["short", "past_a_block"])
@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
def test_flex_dense_teacher_over_the_kept_prompt_keys(peaky_model_factory, layout, prompts):
    """SMD's dense teacher after a FlexAttention shadow pass: its completions over the kept prompt keys run
    FlexAttention too (the whole row's dense view, prompt queries zero, those of whole prompt blocks skipped), equal
    to a dense SDPA pass (forward)."""
    from tests.test_learner import _rollout

    model = peaky_model_factory("qwen3", dtype=torch.float32)
    rollout = _rollout(model, lengths=prompts)
    with torch.no_grad():
        masked = learner_hidden_states(model, rollout, layout=layout, backend="flex", keep_prompt_kv=True)
        teacher = dense_hidden_states(model, rollout, masked)  # [B, N, H]
        dense = learner_hidden_states(model, rollout, shadow=False, layout=layout, backend="sdpa").hidden
    assert masked.backend == "flex"
    assert ((teacher - dense) * rollout.completion_mask[..., None]).abs().max() <= 1e-4


def _leading_query_case():  # [prompt | 2 slots] rows, W = 200: one whole 128-row query block of prompt
    layout = (torch.tensor([200, 150]), 200, 2, 60)  # prompt lengths, width W, slots, slot width
    mask = flex.packed_block_mask(*layout, None, 2, None)
    return mask, flex.without_leading_queries(mask, 200), 200 // mask.BLOCK_SIZE[0]


def test_without_leading_queries_empties_only_whole_padding_blocks():
    """The slots-only pass's query rows ``[0, W)`` are padding: the query blocks wholly inside them list no key
    block, the block across ``W`` and every later one keep theirs."""
    mask, skipped, first = _leading_query_case()
    assert first == 1 and int(mask.kv_num_blocks[..., :first].sum() + mask.full_kv_num_blocks[..., :first].sum()) > 0
    assert int(skipped.kv_num_blocks[..., :first].sum() + skipped.full_kv_num_blocks[..., :first].sum()) == 0
    assert torch.equal(skipped.kv_num_blocks[..., first:], mask.kv_num_blocks[..., first:])
    assert torch.equal(skipped.full_kv_num_blocks[..., first:], mask.full_kv_num_blocks[..., first:])
    assert torch.equal(skipped.kv_indices, mask.kv_indices)
    assert torch.equal(skipped.full_kv_indices, mask.full_kv_indices)
    assert flex.without_leading_queries(mask, 127) is mask
    plan = PackedPlan(torch.tensor([200, 150]), 200, 2, 60, backend="flex", slots_only=True)
    assert torch.equal(plan._block_mask(0, 2, None).kv_num_blocks, skipped.kv_num_blocks)  # the teacher's pass


@pytest.mark.slow
def test_without_leading_queries_computes_zero_rows_and_the_same_others():
    """The learner's compiled FlexAttention (eager FlexAttention ignores the block lists): the skipped blocks' rows
    are zero, the others exactly those of the full mask."""
    from lit_smd.kv.features import PLAIN

    mask, skipped, first = _leading_query_case()
    g = torch.Generator().manual_seed(0)
    rows, size = mask.kv_num_blocks.shape[0], mask.seq_lengths[0]
    query, key, value = (torch.randn(rows, 2, size, 8, generator=g) for _ in range(3))
    expected = flex.flex_feature_attention(query, key, value, mask, 0.35, PLAIN)
    out = flex.flex_feature_attention(query, key, value, skipped, 0.35, PLAIN)
    boundary = first * mask.BLOCK_SIZE[0]
    assert torch.equal(out[:, :, boundary:], expected[:, :, boundary:])
    assert out[:, :, :boundary].abs().max() == 0 < expected[:, :, :boundary].abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("sort", [False, True], ids=["keys_in_order", "keys_sorted"])
def test_compilations_stop_growing_with_the_number_of_batches(monkeypatch, sort):
    """Batches of varying width and size compile once per bucket (block mask + attention), however many batches
    come; past `RECOMPILE_LIMIT` a call raises instead of running eager FlexAttention."""
    heads, kv_heads, dim = 4, 2, 8
    g = torch.Generator().manual_seed(0)

    def run(rows: int, width: int) -> None:
        plan = _plan(rows, width, kv_heads, shadow=True, seed=width, sort=sort)
        query = torch.randn(rows, heads, width, dim, generator=g)
        key, value = (torch.randn(rows, kv_heads, width, dim, generator=g) for _ in range(2))
        with torch.no_grad():
            out = plan.attend(0, query, key, value, dim**-0.5, 0.0, None)  # [B, T, Hq, D]
        visible = _naive_visible(plan, 0, width, None).repeat_interleave(heads // kv_heads, dim=1)
        reference = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=visible, scale=dim**-0.5
        ).transpose(1, 2)
        assert (out - reference).abs().max() <= 1e-5

    start = flex_compilations()
    run(3, 150)  # bucket (4, 160): batches of 3 and 4 rows share the batch bucket 4
    first = flex_compilations()
    assert first - start <= 2  # the block-mask builder and the attention (0 if an earlier test compiled them)
    for rows, width in [(4, 131), (3, 160), (4, 145), (4, 140), (3, 155), (4, 133), (3, 159)]:  # same buckets
        run(rows, width)
    assert flex_compilations() == first
    run(3, 170)  # a new width bucket (192)
    second = flex_compilations()
    for rows, width in [(4, 180), (3, 140), (4, 190), (3, 175), (4, 150)]:
        run(rows, width)
    assert flex_compilations() == second
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
    with pytest.raises(FlexRecompileLimitError, match="RECOMPILE_LIMIT=1"):
        run(3, 300)  # a third bucket, over the limit


@pytest.mark.slow
def test_compiled_flex_skips_the_blocks_a_recent_window_evicts(peaky_model_factory, monkeypatch):
    """StreamingLLM's window (4 sinks, 24 keys) after a ~300-token prompt: every shadow BlockMask (keys reordered by
    eviction step, `lit_smd.kv.flex_sorted`) skips blocks of evicted keys, and compiled FlexAttention still equals
    SDPA per row and shared prefix (float32, forward) and replays the sampler."""
    from lit_smd.kv import flex_sorted

    model = peaky_model_factory("qwen3", dtype=torch.float32)
    ids, mask = _prompts(model.config.vocab_size, lengths=(300, 287))
    rollout = generate(model, ids, mask, compressor=make_compressor("recent"), max_new_tokens=100, num_generations=2,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    build, kinds = flex_sorted._block_mask, []

    def counting_block_mask(skipped, full, mask_mod, size):  # [F, QB, KB]: below the diagonal of a real row
        kinds.append((bool((skipped[0] & torch.ones_like(skipped[0]).tril(-1)).any()), bool(full.any())))
        return build(skipped, full, mask_mod, size)

    monkeypatch.setattr(flex_sorted, "_block_mask", counting_block_mask)
    completion = rollout.completion_mask[..., None]
    with torch.no_grad():
        for layout in ("per_row", "shared_prefix"):
            flex_out = learner_hidden_states(model, rollout, layout=layout, backend="flex").hidden
            sdpa_out = learner_hidden_states(model, rollout, layout=layout, backend="sdpa").hidden
            assert ((flex_out - sdpa_out) * completion).abs().max() <= 1e-5, layout
        flex_logprobs = score(model, rollout, backend="flex")
    assert (flex_logprobs - rollout.logprobs)[rollout.completion_mask].abs().max() <= 1e-4
    assert all(skipped for skipped, _ in kinds) and len(kinds) == 3 * model.config.num_hidden_layers


@pytest.mark.slow
def test_flex_forward_replays_shadow_mask_on_cpu(peaky_model_factory):
    model = peaky_model_factory("qwen3", dtype=torch.float32)
    ids, mask = _prompts(256)
    rollout = generate(model, ids, mask, compressor=make_compressor("h2o"), max_new_tokens=16,
                       generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        flex_logprobs = score(model, rollout, backend="flex")
        sdpa_logprobs = score(model, rollout, backend="sdpa")
    assert (flex_logprobs - rollout.logprobs).abs().max() <= 1e-4
    assert (flex_logprobs - sdpa_logprobs).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type",
    [
        "gemma2",
        pytest.param(
            "gpt_oss",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="compiled flex on CPU returns no lse (torch 2.13)"
            ),
        ),
    ],
)
def test_flex_forward_honours_softcap_and_sinks(model_type):
    """Gemma 2's softcap (a score_mod) and GPT-OSS's sinks (an lse rescaling) on the FlexAttention path."""
    from tests.test_families import build, sample

    model = build(model_type).float()
    rollout = sample(model, make_compressor("prefill_then_decode", budget=0.5), num_samples=2)
    with torch.no_grad():
        flex_logprobs = score(model, rollout, backend="flex")
        sdpa_logprobs = score(model, rollout, backend="sdpa")
    mask = rollout.completion_mask
    assert (flex_logprobs - sdpa_logprobs)[mask].abs().max() <= 1e-4
    assert (flex_logprobs - rollout.logprobs)[mask].abs().max() <= 1e-4


@pytest.mark.slow
def test_flex_forward_mla_keys_wider_than_values():
    """DeepSeek-V3's latent attention (one eviction record per layer, keys wider than values) on the FlexAttention
    path: both layouts and views, and SMD's dense teacher over the kept prompt keys, against SDPA (forward)."""
    from tests.test_families import build, sample

    model = build("deepseek_v3").float()
    rollout = sample(model, make_compressor("prefill_then_decode", budget=0.5), num_samples=2)
    mask = rollout.completion_mask[..., None]
    with torch.no_grad():
        for layout in ("per_row", "shared_prefix"):
            for shadow in (True, False):
                flex_out = learner_hidden_states(model, rollout, shadow=shadow, layout=layout, backend="flex").hidden
                sdpa_out = learner_hidden_states(model, rollout, shadow=shadow, layout=layout, backend="sdpa").hidden
                assert ((flex_out - sdpa_out) * mask).abs().max() <= 1e-4, (layout, shadow)
            masked = learner_hidden_states(model, rollout, layout=layout, backend="flex", keep_prompt_kv=True)
            teacher = dense_hidden_states(model, rollout, masked)
            assert ((teacher - sdpa_out) * mask).abs().max() <= 1e-4, layout
        replayed = score(model, rollout, backend="flex")
    assert (replayed - rollout.logprobs)[rollout.completion_mask].abs().max() <= 1e-4
