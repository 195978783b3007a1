"""The shared-prefix learner pass equals the per-row pass: log-probs and parameter gradients in float64.

Each group is packed into one row ``[prompt | c_1 | ... | c_G]`` (`lit_smd.learner`); the reference is the
per-row layout (``layout="per_row"``), an independent implementation (one row per sample, the shadow mask replayed
over the full ``[T, T]`` grid). Rollouts are left-padded, with completions of different lengths,
on GQA tiny models of every family.

Transformers' RMSNorm computes in float32 even in a float64 model, which caps the agreement of two float64 passes
that sum the same gradients in a different order at ~1e-7; the models here get a float64 RMSNorm
(`lit_smd.kv.precision.keep_float64_norms`, which `ensure_attention` also applies)
so that the comparison measures our arithmetic at float64 precision.
"""

import copy
import warnings

import pytest
import torch

from lit_smd.datamodules import ScoredRollout
from lit_smd.kv import H2O, NEVER, PrefillThenDecode, SnapKV
from lit_smd.kv.precision import keep_float64_norms
from lit_smd.learner import dense_hidden_states, learner_hidden_states, score, shareable_groups
from lit_smd.losses.sparse_rl import SparseRLConfig
from lit_smd.modules.grpo import GRPOModule
from lit_smd.rollout import Rollout, generate
from lit_smd.tiny import MLA_FAMILIES
from tests.kv.test_blocked import spy_on_blocks

GROUP, NEW = 3, 12


def _float64_norms(model):
    """``model`` with every RMSNorm computing in the input's dtype (see the module docstring)."""
    assert keep_float64_norms(model) > 0
    return model


@pytest.fixture
def model64(peaky_model_factory):
    return lambda family, **kwargs: _float64_norms(peaky_model_factory(family, **kwargs))


def _rollout(model, *, lengths=(40, 31), compressor=True, seed=1) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(7, model.config.vocab_size, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    compressor = PrefillThenDecode(SnapKV(20, window=8), H2O(20, window=4)) if compressor else None
    rollout = generate(model, ids.masked_fill(mask == 0, 0), mask, compressor=compressor, max_new_tokens=NEW,
                       num_generations=GROUP, generator=g)  # fmt: skip
    # Completions of different lengths: cut rows short as if they had stopped (a prefix of a trajectory is one too).
    keep = torch.tensor([NEW, NEW - 5, 3, NEW - 1, 7, NEW][: len(rollout)])
    cut = torch.arange(NEW)[None, :] >= keep[:, None]
    rollout.completion_mask = rollout.completion_mask & ~cut
    rollout.completion_ids = rollout.completion_ids.masked_fill(cut, 0)
    rollout.logprobs = rollout.logprobs.masked_fill(cut, 0.0)
    return rollout


def _logprobs_and_grads(model, rollout, hidden_fn):
    model.zero_grad()
    hidden = hidden_fn()  # [B, N, H]
    logprobs = torch.log_softmax(model.get_output_embeddings()(hidden), dim=-1)
    logprobs = logprobs.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    logprobs = logprobs.masked_fill(~rollout.completion_mask, 0)
    weights = torch.linspace(-1.0, 2.0, logprobs.numel()).view_as(logprobs).to(logprobs)
    (logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


def _per_row(model, rollout, shadow):
    return learner_hidden_states(model, rollout, shadow=shadow, layout="per_row").hidden  # [B, N, H]


def _assert_same(model, rollout, shadow, **kwargs):
    ref_lp, ref_grads = _logprobs_and_grads(model, rollout, lambda: _per_row(model, rollout, shadow))
    new_lp, new_grads = _logprobs_and_grads(
        model, rollout, lambda: learner_hidden_states(model, rollout, shadow=shadow, **kwargs).hidden
    )
    assert (ref_lp - new_lp).abs().max() <= 1e-10
    assert set(ref_grads) == set(new_grads) and len(ref_grads) > 0
    for name, grad in ref_grads.items():
        assert (grad - new_grads[name]).abs().max() <= 1e-10, name
    assert max(g.abs().max() for g in ref_grads.values()) > 1e-3


@pytest.mark.parametrize("shadow", [False, True], ids=["dense", "shadow"])
def test_shared_prefix_equals_per_row_in_float64(model64, family, shadow):
    model = model64(family)
    if family not in MLA_FAMILIES:  # MLA: one latent per token, expanded into as many key heads as query heads
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    rollout = _rollout(model)
    assert int((rollout.shadow_mask.evict_steps < NEVER).sum()) > 0
    shareable, group = shareable_groups(rollout, shadow=shadow)
    assert shareable.all() and group.tolist() == [0, 0, 0, 1, 1, 1]
    _assert_same(model, rollout, shadow)


def test_sliding_window_layers(model64):
    model = model64("mistral", sliding_window=16)
    rollout = _rollout(model)
    for shadow in (False, True):
        _assert_same(model, rollout, shadow)


def test_prompt_evicted_during_encoding_falls_back_to_per_row(model64):
    model = model64("qwen3")
    rollout = _rollout(model)
    rollout.shadow_mask.evict_steps[0, 1, 0, 2] = 10  # row 1 lost prompt key 2 before its prompt ended
    shareable, group = shareable_groups(rollout, shadow=True)
    assert shareable.tolist() == [True, False, True, True, True, True]
    assert group.tolist() == [0, -1, 1, 2, 2, 2]
    _assert_same(model, rollout, True)
    assert shareable_groups(rollout, shadow=False)[0].all()  # the dense view shares regardless


def test_differing_prompts_within_a_group_are_not_shared(model64):
    model = model64("llama")
    rollout = _rollout(model)
    rollout.prompt_ids[2, -5] = (rollout.prompt_ids[2, -5] + 1) % model.config.vocab_size
    shareable, group = shareable_groups(rollout, shadow=True)
    assert group.tolist() == [0, 0, 1, 2, 2, 2]
    _assert_same(model, rollout, True)


def test_minibatch_slices_and_dense_rollouts(model64):
    model = model64("qwen3")
    rollout = _rollout(model, compressor=False)
    _assert_same(model, rollout.select(slice(1, 5)), False)  # a slice splitting both groups


@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
def test_dense_teacher_reuses_the_prompt_and_matches_a_dense_pass(model64, family, layout, monkeypatch):
    import lit_smd.learner as learner_module

    model = model64(family)
    rollout = _rollout(model)
    rollout.shadow_mask.evict_steps[1, 4, -1, 0] = 5  # row 4's prompt differs in the shadow view: a full dense pass
    learner = learner_hidden_states(model, rollout, shadow=True, layout=layout, keep_prompt_kv=True)
    kept = learner._packing.plan.prompt_kv if layout == "shared_prefix" else learner._row_prompt_kv
    assert kept, "the masked pass kept no prompt keys"
    full_rows = []
    per_row = learner_module._per_row_hidden_states
    spy = lambda model, rollout, **kwargs: full_rows.append(len(rollout)) or per_row(model, rollout, **kwargs)  # noqa: E731
    monkeypatch.setattr(learner_module, "_per_row_hidden_states", spy)
    teacher = dense_hidden_states(model, rollout, learner)
    assert full_rows == [1], "only the row whose prompt differs may run its prompt again"
    assert not teacher.requires_grad
    monkeypatch.undo()
    expected = _per_row(model, rollout, False)
    valid = rollout.completion_mask[..., None]
    assert ((teacher - expected) * valid).abs().max() <= 1e-10
    masked = _per_row(model, rollout, True)
    assert ((masked - expected) * valid).abs().max() > 1e-3  # the two views differ: the test can fail


def _saved_tensors(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        result = fn()
    return result, saved


def _two_length_axes(saved, lengths):
    """Saved tensors with two axes of a sequence length (a mask or score block between forward and backward)."""
    return [(shape, dtype) for shape, dtype in saved if sum(size in lengths for size in shape[-2:]) >= 2]


@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
def test_no_mask_or_scores_are_kept_for_backward(model64, layout, monkeypatch):
    import lit_smd.kv.blocked as blocked
    import lit_smd.kv.packed as packed_module
    import lit_smd.kv.rows as rows_module

    model = model64("qwen3")
    rollout = _rollout(model)
    packed = learner_hidden_states(model, rollout, shadow=True)._packing.plan
    lengths = {packed.width, packed.prompt_width + packed.slot_width, rollout.prompt_ids.shape[1] + NEW}
    lengths |= {packed.prompt_width, packed.slot_width}
    assert not lengths & {model.config.hidden_size, model.config.head_dim}  # the shapes below are unambiguous
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 64)  # several query blocks per layer
    _, saved = _saved_tensors(lambda: learner_hidden_states(model, rollout, shadow=True, layout=layout))
    assert saved, "nothing was saved: the hooks did not run"
    # Every query block is fused (its mask and keys rebuilt in the backward) or checkpointed: none of its masks,
    # per-slot key copies or scores is kept.
    assert not [shape for shape, dtype in saved if dtype == torch.bool]
    assert not _two_length_axes(saved, lengths)
    # Without either, each block's mask (as SDPA's float mask) is kept: the check above can fail.
    monkeypatch.setattr(blocked, "PRUNE_BELOW", 0.0)  # full key ranges: the masks' last axis is a length above
    blocks = blocked.over_query_blocks
    for module in (rows_module, packed_module):
        monkeypatch.setattr(module, "fused_blocks", lambda *args: False)
        monkeypatch.setattr(module, "over_query_blocks", lambda run, n, block, recompute: blocks(run, n, block,
                                                                                                recompute=False))
    _, unchecked = _saved_tensors(lambda: learner_hidden_states(model, rollout, shadow=True, layout=layout))
    assert _two_length_axes(unchecked, lengths)


@pytest.mark.parametrize(("lengths", "max_groups"), [((40, 40), 8), ((40, 31), 8), ((40, 31), 1)])
def test_dense_slot_attention_runs_whole_slots_with_bounded_masks(model64, lengths, max_groups, monkeypatch):
    """The dense view's slot queries run in blocks of `DENSE_BLOCK` (here one per slot; two kernel calls each: the
    earlier keys, the block's own keys causally), not the shadow view's `VISIBLE_BLOCK`. Padded prompts make the rows
    see different numbers of prompt keys: the rows run in groups, still whole slots without a mask; allowed one group
    (`MAX_ROW_GROUPS`), blocks shrink until the mask fits `BLOCK_ELEMENTS`. The values stay the per-row pass's."""
    import lit_smd.kv.blocked as blocked

    model = model64("qwen3")
    rollout = _rollout(model, lengths=lengths)
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 200)  # padded prompts: a whole slot's mask would be 504
    monkeypatch.setattr(blocked, "MIN_BLOCK", 2)
    monkeypatch.setattr(blocked, "VISIBLE_BLOCK", 4)  # the shadow view's block, shorter than a slot here
    monkeypatch.setattr(blocked, "MAX_ROW_GROUPS", max_groups)
    blocks, masks, groups = [], [], []

    def record(limit, start, stop, block_groups):
        blocks.append(stop - start)
        groups.append(len(block_groups))
        pieces = [piece for group in block_groups for piece in group.pieces]
        masks.extend(piece.mask(torch.float32).numel() for piece in pieces if piece.visibility is not None)

    spy_on_blocks(monkeypatch, record)
    packed = learner_hidden_states(model, rollout, shadow=False)
    assert packed._packing is not None and blocks
    if max_groups > 1:
        assert set(blocks) == {packed._packing.plan.slot_width} and not masks
        assert max(groups) == (1 if lengths[0] == lengths[1] else 2)
    else:
        assert masks and max(masks) <= 200 and max(blocks) < packed._packing.plan.slot_width
    expected = learner_hidden_states(model, rollout, shadow=False, layout="per_row").hidden
    mask = rollout.completion_mask[..., None]
    assert torch.allclose(packed.hidden * mask, expected * mask, atol=1e-5)


def test_dense_slot_attention_leaves_out_a_slots_padding(model64, monkeypatch):
    """Completions of different lengths: the dense view's slots go into the batch and the query blocks wholly in a
    slot's padding are left out, as in the shadow view (the slot of a 3-token completion runs its first block only);
    log-probs and gradients stay the per-row pass's."""
    import lit_smd.kv.blocked as blocked
    import lit_smd.kv.packed as packed_module

    model = model64("qwen3")
    rollout = _rollout(model)  # completions of 12, 7, 3, 11, 7 and 12 tokens, two prompts
    for module in (blocked, packed_module):
        monkeypatch.setattr(module, "DENSE_BLOCK", 4)
    walked = []  # (start, rows of the block) per query block of the forward
    spy_on_blocks(monkeypatch, lambda limit, start, stop, groups: walked.append((start, limit.shape[0], groups)))
    with torch.no_grad():
        packed = learner_hidden_states(model, rollout, shadow=False)
    plan = packed._packing.plan
    assert plan.slot_width == NEW and plan.slot_lengths.tolist() == [[12, 7, 3], [11, 7, 12]]
    layer = [(start, rows, groups) for start, rows, groups in walked if rows == 6][: NEW // 4]  # the first layer
    assert [start for start, _, _ in layer] == [0, 4, 8]
    counted = [sorted(row for group in groups for row in torch.arange(6)[group.rows].tolist())
               for _, _, groups in layer]  # fmt: skip
    assert counted == [[0, 1, 2, 3, 4, 5], [0, 1, 3, 4, 5], [0, 3, 5]]  # slots in the batch: [R*S]
    def hidden(layout):
        return lambda: learner_hidden_states(model, rollout, shadow=False, layout=layout).hidden

    expected, expected_grads = _logprobs_and_grads(model, rollout, hidden("per_row"))
    logprobs, grads = _logprobs_and_grads(model, rollout, hidden("shared_prefix"))
    assert (logprobs - expected).abs().max() <= 1e-12
    assert all((grads[name] - grad).abs().max() <= 1e-12 for name, grad in expected_grads.items())


def test_dense_rows_leave_out_padding_blocks(model64, monkeypatch):
    """Per row, the dense view runs the fused causal kernel over whole rows unless a row's padding fills whole
    `DENSE_BLOCK` query blocks: then `visible_attention`'s blocks, which leave those out; log-probs and gradients stay
    the whole-row kernel's."""
    import lit_smd.kv.blocked as blocked
    import lit_smd.kv.rows as rows_module

    model = model64("qwen3")
    rollout = _rollout(model)  # rows of 52, 47, 43 (prompt 40) and 42, 38, 43 (prompt 31) tokens, width 52

    def hidden():
        return learner_hidden_states(model, rollout, shadow=False, layout="per_row").hidden

    expected, expected_grads = _logprobs_and_grads(model, rollout, hidden)  # one fused call per layer
    walked = []
    spy_on_blocks(monkeypatch, lambda limit, start, stop, groups: walked.append((start, stop, groups)))
    assert not walked
    for module in (blocked, rows_module):
        monkeypatch.setattr(module, "DENSE_BLOCK", 16)
    monkeypatch.setattr(blocked, "VISIBLE_BLOCK", 4)  # below DENSE_BLOCK, as by default: the blocks grow to it
    logprobs, grads = _logprobs_and_grads(model, rollout, hidden)
    assert (logprobs - expected).abs().max() <= 1e-12
    assert all((grads[name] - grad).abs().max() <= 1e-12 for name, grad in expected_grads.items())
    first_layer = walked[:4]
    assert [(start, stop) for start, stop, _ in first_layer] == [(0, 16), (16, 32), (32, 48), (48, 52)]
    counted = [sorted(torch.arange(6)[group.rows].tolist()) for _, _, groups in first_layer for group in groups]
    assert counted == [[0, 1, 2, 3, 4, 5]] * 3 + [[0]]  # only the 52-token row reaches column 48


def test_checkpointed_slot_attention_holds_only_storage_autograd_keeps_anyway(model64, monkeypatch):
    """The checkpoint keeps its inputs for the recomputation; they must be slices of tensors saved elsewhere, or the
    activation memory the benchmark counts (saved tensors) would miss them."""
    from lit_smd.kv.packed import PackedPlan

    model = model64("qwen3")
    rollout = _rollout(model)
    inputs, attend_slots = [], PackedPlan._attend_slots

    def spy(self, layer_idx, *tensors_and_args):
        inputs.extend(x.untyped_storage().data_ptr() for x in tensors_and_args[:5])
        return attend_slots(self, layer_idx, *tensors_and_args)

    monkeypatch.setattr(PackedPlan, "_attend_slots", spy)
    saved = set()
    keep = lambda t: saved.add(t.untyped_storage().data_ptr()) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        learner_hidden_states(model, rollout, shadow=True)
    assert len(inputs) == 5 * model.config.num_hidden_layers
    assert all(pointer in saved for pointer in inputs)


def test_unknown_layout_is_rejected(tiny_model):
    rollout = _rollout(tiny_model, compressor=False)
    with pytest.raises(ValueError, match="layout must be one of"):
        learner_hidden_states(tiny_model, rollout, layout="packed")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'sdpa', 'flex'\), got 'cuda'"):
        learner_hidden_states(tiny_model, rollout, backend="cuda")  # before: silently SDPA
    with pytest.raises(ValueError, match=r"backend must be one of"):
        score(tiny_model, rollout, backend="math")


def test_grpo_module_runs_every_pass_on_its_attention_backend(monkeypatch, tiny_model):
    """``attention_backend`` reaches the teacher-forced passes of an SMD step (the dense teacher then runs on the
    masked pass's kernel, `LearnerPass.backend`)."""
    import lit_smd.modules._grpo_smd as grpo_smd

    seen = []

    def spy(*args, backend, **kwargs):
        seen.append(backend)
        return learner_hidden_states(*args, backend=backend, **kwargs)

    monkeypatch.setattr(grpo_smd, "learner_hidden_states", spy)
    compressor = PrefillThenDecode(SnapKV(20, window=8), H2O(20, window=4))
    module = GRPOModule(tiny_model, mode="smd", compressor=compressor, attention_backend="sdpa")
    rollout = _rollout(tiny_model)
    rewards = torch.arange(len(rollout), dtype=torch.float32)
    loss = module.training_step(module.make_experience(ScoredRollout(rollout, rewards, num_generations=GROUP)), 0)
    loss.backward()
    assert seen and set(seen) == {"sdpa"}
    assert GRPOModule(tiny_model, mode="dense").attention_backend == "auto"


@pytest.mark.parametrize("mode", ["dense", "naive", "sparse_rl", "smd"])
def test_grpo_module_layouts_give_the_same_experience_loss_and_gradients(model64, mode):
    """Every pass of a GRPO step (reference k3, Sparse-RL's dense pi_old, policy, SMD's dense teacher) agrees."""
    policy = model64("qwen3")
    rollout = _rollout(policy, compressor=mode != "dense")
    compressor = None if mode == "dense" else PrefillThenDecode(SnapKV(20, window=8), H2O(20, window=4))
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.25])
    sparse_rl = SparseRLConfig(veto_threshold=1e-30, lower=1e-9, upper=1e9, truncate=1e9)  # keep every row
    results = {}
    for layout in ("per_row", "shared_prefix"):
        module = GRPOModule(copy.deepcopy(policy), mode=mode, compressor=compressor, beta=0.04, learner_layout=layout,
                            sparse_rl=sparse_rl, temperature=0.9, logits_chunk_size=16)  # fmt: skip
        experience = module.make_experience(
            ScoredRollout(rollout, rewards, num_generations=GROUP, num_iterations=2)
        )  # pi_old computed
        module.policy.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log outside a Trainer
            loss = module.training_step(experience, 0)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in module.policy.named_parameters() if p.grad is not None}
        results[layout] = (experience, loss.detach(), grads)
    (old, old_loss, old_grads), (new, new_loss, new_grads) = results["per_row"], results["shared_prefix"]
    assert (old.ref_logprobs - new.ref_logprobs).abs().max() <= 1e-10
    assert (old.old_logprobs - new.old_logprobs).abs().max() <= 1e-10
    assert torch.equal(old.loss_mask, new.loss_mask)
    assert (old_loss - new_loss).abs() <= 1e-10 and old_loss.abs() > 0
    assert set(old_grads) == set(new_grads)
    for name, grad in old_grads.items():
        assert (grad - new_grads[name]).abs().max() <= 1e-10, name


def test_grpo_module_rejects_an_unknown_layout(tiny_model):
    with pytest.raises(ValueError, match="learner_layout must be one of"):
        GRPOModule(tiny_model, mode="dense", learner_layout="packed")


def _naive_slot_visibility(plan, layer: int, window: int | None) -> torch.Tensor:
    """``[R, S, H_kv, N, W + N]`` visibility of each slot query over ``[prompt | own slot]``, from the contract."""
    rows, width, new = plan.prompt_lengths.shape[0], plan.prompt_width, plan.slot_width
    t = torch.arange(new)[:, None]  # [N, 1] slot query
    c = torch.arange(width + new)[None, :]  # [1, W + N] key column
    lengths = plan.prompt_lengths[:, None, None]  # [R, 1, 1]
    query_pos = lengths + t  # logical positions
    key_pos = torch.where(c < width, c, lengths + c - width)
    visible = torch.where(c < width, c < lengths, (c - width) <= t)  # [R, N, W + N]
    if window is not None:
        visible &= (query_pos - key_pos) < window
    visible = visible[:, None, None]  # [R, 1, 1, N, W + N]
    if plan.steps is not None:
        visible = visible & (query_pos[:, None, None] < plan.steps[layer][:, :, :, None, :].transpose(1, 2))
    visible = visible | ((c - width) == t)  # a query sees itself
    return visible.expand(rows, plan.num_slots, -1, -1, -1)


@pytest.mark.parametrize("window", [None, 9])
def test_flex_block_mask_matches_the_contract(model64, window):
    """CUDA's FlexAttention mask of a packed row: slot rows as the shadow-mask contract says, prompt rows causal, the
    bucket's padding (rows and columns) sees nothing. The mask_mod is evaluated uncompiled over the bucketed grid."""
    from torch.nn.attention.flex_attention import create_mask

    from lit_smd.kv.flex import packed_mask_mod

    model = model64("qwen3")
    rollout = _rollout(model)
    plan = learner_hidden_states(model, rollout, shadow=True, backend="sdpa")._packing.plan
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    width, rows = plan.prompt_width, plan.prompt_lengths.shape[0]
    positions = torch.arange(width)
    real_keys = positions[None, None, :] < plan.prompt_lengths[:, None, None]  # [R, 1, W]
    causal = (positions[None, :] <= positions[:, None])[None] & real_keys
    causal |= torch.eye(width, dtype=torch.bool)
    for layer in range(model.config.num_hidden_layers):
        mask_mod, padded_rows, size = packed_mask_mod(
            plan.prompt_lengths, width, plan.num_slots, plan.slot_width, plan.steps[layer], window, heads // kv_heads
        )
        grid = create_mask(mask_mod, padded_rows, heads, size, size, device="cpu")  # [rows, Hq, size, size]
        assert size >= plan.width and padded_rows >= rows
        assert not grid[rows:].any() and not grid[:, :, plan.width :].any() and not grid[..., plan.width :].any()
        dense = grid[:rows, :, : plan.width, : plan.width]  # [R, Hq, T, T]
        slots = _naive_slot_visibility(plan, layer, window).repeat_interleave(heads // kv_heads, dim=2)
        for slot in range(plan.num_slots):
            own = torch.zeros(plan.width, dtype=torch.bool)
            own[width + slot * plan.slot_width : width + (slot + 1) * plan.slot_width] = True
            queries = dense[:, :, own]  # [R, Hq, N, T]
            assert torch.equal(queries[..., :width], slots[:, slot, ..., :width])
            assert torch.equal(queries[..., own], slots[:, slot, ..., width:])
            assert not queries[..., width:][..., ~own[width:]].any()  # never another slot's keys
        expected = causal if window is None else causal & ((positions[:, None] - positions[None, :]) < window)
        assert torch.equal(dense[:, :, :width, :width], expected[:, None].expand(-1, heads, -1, -1))
        assert not dense[:, :, :width, width:].any()


@pytest.mark.slow
def test_flex_forward_matches_sdpa_on_cpu(peaky_model_factory):
    """FlexAttention (CUDA's default) over packed rows, forward only on CPU (no backward there; ~1 min to compile)."""
    model = peaky_model_factory("qwen3", dtype=torch.float32)
    rollout = _rollout(model)
    with torch.no_grad():
        flex = learner_hidden_states(model, rollout, shadow=True, backend="flex").hidden
        sdpa = learner_hidden_states(model, rollout, shadow=True, backend="sdpa").hidden
    assert ((flex - sdpa) * rollout.completion_mask[..., None]).abs().max() <= 1e-4


def test_activation_checkpointing_gives_the_same_gradients(model64):
    model = model64("llama")
    rollout = _rollout(model)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    _assert_same(model, rollout, True)


@pytest.mark.parametrize("path", ["visible", "sdpa"])
@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
def test_query_blocks_and_pruned_keys_replay_the_rollout_exactly(model64, family, layout, path, monkeypatch):
    """Many small query blocks, each over only its live keys, give the one-block pass's log-probs and gradients:
    the fused form (`visible_attention`: a gathered piece without mask and a masked one) and checkpointed SDPA
    blocks over pruned keys."""
    import lit_smd.kv.blocked as blocked
    import lit_smd.kv.packed as packed
    import lit_smd.kv.rows as rows

    model = model64(family)
    if path == "visible" and getattr(model.config, "v_head_dim", None) not in (None, model.config.head_dim):
        pytest.skip("values of another head size than the keys (MLA) run the SDPA blocks, not the fused kernel")
    rollout = _rollout(model)
    reference, reference_grads = _logprobs_and_grads(
        model, rollout, lambda: learner_hidden_states(model, rollout, shadow=True, layout=layout).hidden
    )
    assert (reference - rollout.logprobs).abs().max() <= 1e-12
    pruned = []
    if path == "visible":
        monkeypatch.setattr(blocked, "VISIBLE_BLOCK", 3)
        pieces = blocked._pieces
        spy = lambda *args: pruned.extend(p.index for p in pieces(*args)) or pieces(*args)  # noqa: E731
        monkeypatch.setattr(blocked, "_pieces", spy)
    else:
        monkeypatch.setattr(rows, "fused_blocks", lambda *args: False)
        monkeypatch.setattr(packed, "fused_blocks", lambda *args: False)
        alive_index = blocked.alive_index
        monkeypatch.setattr(blocked, "MIN_BLOCK", 4)
        monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 64)
        monkeypatch.setattr(blocked, "PRUNE_BELOW", 1.0)
        spy = lambda alive: pruned.append(alive_index(alive)) or pruned[-1]  # noqa: E731
        monkeypatch.setattr(blocked, "alive_index", spy)  # both layouts prune through blocked.live_keys
    logprobs, grads = _logprobs_and_grads(
        model, rollout, lambda: learner_hidden_states(model, rollout, shadow=True, layout=layout).hidden
    )
    assert any(index is not None for index in pruned), "no block pruned a key: the test would be vacuous"
    assert (logprobs - rollout.logprobs).abs().max() <= 1e-12
    for name, grad in reference_grads.items():
        assert (grad - grads[name]).abs().max() <= 1e-10, name


@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
def test_blocks_grow_where_no_key_dies_and_replay_exactly(model64, layout, monkeypatch):
    """SnapKV alone evicts only at prefill, so no key dies over the prompt's queries nor over the completions: the
    shadow view's blocks grow past `VISIBLE_BLOCK` (here 3) up to `DENSE_BLOCK` (here 16), the replay stays exact and
    the gradients are those of fixed blocks."""
    import lit_smd.kv.blocked as blocked

    model = model64("qwen3")
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(7, model.config.vocab_size, (2, 40), generator=generator)
    rollout = generate(model, ids, torch.ones_like(ids), compressor=SnapKV(20, window=8), max_new_tokens=NEW,
                       num_generations=GROUP, generator=generator)  # fmt: skip
    monkeypatch.setattr(blocked, "VISIBLE_BLOCK", 3)
    monkeypatch.setattr(blocked, "DENSE_BLOCK", 16)
    sizes = []
    spy_on_blocks(monkeypatch, lambda limit, start, stop, groups: sizes.append(stop - start))

    def hidden():
        return learner_hidden_states(model, rollout, shadow=True, layout=layout).hidden

    logprobs, grads = _logprobs_and_grads(model, rollout, hidden)
    assert max(sizes) > 3, sizes
    assert (logprobs - rollout.logprobs).abs().max() <= 1e-12
    monkeypatch.setattr(blocked, "_death_indices", lambda *args: None)  # fixed blocks of 3
    sizes.clear()
    _, fixed_grads = _logprobs_and_grads(model, rollout, hidden)
    assert max(sizes) <= 3
    for name, grad in fixed_grads.items():
        assert (grad - grads[name]).abs().max() <= 1e-10, name


def test_rows_of_different_lengths_run_in_groups_and_replay_exactly(model64, monkeypatch):
    """Per row, prompts of 40 and 31 tokens, completions cut at different lengths: a row still in its prompt sees
    every earlier key where another, in its completion or padding, sees about half, so blocks run per group of rows.
    The replay stays exact and the gradients are those of one group per block (`MAX_ROW_GROUPS` 1: the surplus keys
    under a mask). (Shared prefix, the slots see the prompt as the compressor kept it: 20 keys of either prompt.)"""
    import lit_smd.kv.blocked as blocked

    model = model64("qwen3")
    rollout = _rollout(model)
    monkeypatch.setattr(blocked, "VISIBLE_BLOCK", 3)
    groups = []
    spy_on_blocks(monkeypatch, lambda limit, start, stop, block_groups: groups.append(len(block_groups)))

    logprobs, grads = _logprobs_and_grads(model, rollout, lambda: _per_row(model, rollout, True))
    assert max(groups) >= 2, groups
    assert (logprobs - rollout.logprobs).abs().max() <= 1e-12
    monkeypatch.setattr(blocked, "MAX_ROW_GROUPS", 1)
    groups.clear()
    _, together = _logprobs_and_grads(model, rollout, lambda: _per_row(model, rollout, True))
    assert max(groups) == 1
    for name, grad in together.items():
        assert (grad - grads[name]).abs().max() <= 1e-10, name


@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
def test_query_blocks_past_a_rows_end_are_left_out_and_replay_exactly(model64, layout, monkeypatch):
    """Completions that end early (here 12, 7, 3, 11, 7 and 12 of 12 tokens): the shadow view leaves out the query
    blocks wholly past a row's (or a slot's) last token. The replay stays exact and the gradients are those of
    checkpointed SDPA blocks, which compute every query."""
    import lit_smd.kv.blocked as blocked
    import lit_smd.kv.packed as packed
    import lit_smd.kv.rows as rows

    model = model64("qwen3")
    rollout = _rollout(model)
    monkeypatch.setattr(blocked, "VISIBLE_BLOCK", 3)
    left_out = []

    def record(limit, start, stop, groups):
        left_out.append(limit.shape[0] - sum(len(torch.arange(limit.shape[0])[group.rows]) for group in groups))

    spy_on_blocks(monkeypatch, record)

    def hidden():
        return learner_hidden_states(model, rollout, shadow=True, layout=layout).hidden

    logprobs, grads = _logprobs_and_grads(model, rollout, hidden)
    assert max(left_out) > 0, left_out
    assert (logprobs - rollout.logprobs).abs().max() <= 1e-12
    monkeypatch.setattr(rows, "fused_blocks", lambda *args: False)
    monkeypatch.setattr(packed, "fused_blocks", lambda *args: False)
    _, every_query = _logprobs_and_grads(model, rollout, hidden)
    for name, grad in every_query.items():
        assert (grad - grads[name]).abs().max() <= 1e-10, name


def test_per_row_teacher_runs_in_row_chunks_with_the_same_states(model64, monkeypatch):
    """Without a shared prefix the dense teacher runs a few rows per decoder call (its transient is a chunk's, not the
    batch's): the same hidden states as one call."""
    import lit_smd.learner as learner_module

    model = model64("qwen3")
    rollout = _rollout(model)
    masked = learner_hidden_states(model, rollout, shadow=True, layout="per_row")
    with torch.no_grad():
        whole = dense_hidden_states(model, rollout, masked)
        calls = []
        per_row = learner_module._per_row_hidden_states
        spy = lambda *args, **kwargs: calls.append(1) or per_row(*args, **kwargs)  # noqa: E731
        monkeypatch.setattr(learner_module, "_per_row_hidden_states", spy)
        monkeypatch.setattr(learner_module, "TEACHER_TOKENS", 1)  # one row per call
        chunked = dense_hidden_states(model, rollout, masked)
    assert len(calls) == len(rollout) > 1
    valid = rollout.completion_mask[..., None]
    assert ((chunked - whole) * valid).abs().max() <= 1e-12
    assert ((whole - _per_row(model, rollout, False)) * valid).abs().max() <= 1e-12


@pytest.mark.parametrize("tokens", ["one slot", "one row"])
def test_shared_prefix_teacher_runs_in_chunks_with_the_same_states(model64, monkeypatch, tokens):
    """The packed dense teacher runs `TEACHER_TOKENS` at a time, whole slots (one slot per call, or a packed row's
    slots): the same hidden states as one call over every slot, and as the dense per-row pass."""
    import lit_smd.learner as learner_module

    model = model64("qwen3")
    rollout = _rollout(model)
    masked = learner_hidden_states(model, rollout, shadow=True, keep_prompt_kv=True)
    plan = masked._packing.plan
    rows, slots = len(plan.prompt_lengths), plan.num_slots
    assert rows > 1 and slots > 1
    with torch.no_grad():
        whole = dense_hidden_states(model, rollout, masked)
        calls = []
        run = learner_module._run_decoder
        spy = lambda model, ids, *args: calls.append(ids.numel()) or run(model, ids, *args)  # noqa: E731
        monkeypatch.setattr(learner_module, "_run_decoder", spy)
        per_call = 1 if tokens == "one slot" else slots * plan.slot_width
        monkeypatch.setattr(learner_module, "TEACHER_TOKENS", per_call)
        chunked = dense_hidden_states(model, rollout, masked)
    expected_calls = rows * slots if tokens == "one slot" else rows
    assert calls == [rows * slots * plan.slot_width // expected_calls] * expected_calls
    valid = rollout.completion_mask[..., None]
    assert ((chunked - whole) * valid).abs().max() <= 1e-12
    assert ((whole - _per_row(model, rollout, False)) * valid).abs().max() <= 1e-12


def test_flex_teacher_runs_the_packed_batch_in_one_call(model64, monkeypatch):
    """On FlexAttention the packed teacher is one decoder call, the masked pass's shape (a chunk's batch or width
    would be one more compilation)."""
    import lit_smd.learner as learner_module

    model = model64("qwen3")
    rollout = _rollout(model)
    masked = learner_hidden_states(model, rollout, shadow=True, keep_prompt_kv=True)
    plan = masked._packing.plan
    plan.backend = "flex"  # the chunking policy only: the decoder call below is stubbed
    calls = []

    def stub(model, ids, positions, chunk_plan):
        calls.append((ids.shape, chunk_plan.num_slots, chunk_plan.backend))
        return torch.zeros(*ids.shape, model.config.hidden_size)

    monkeypatch.setattr(learner_module, "_run_decoder", stub)
    monkeypatch.setattr(learner_module, "TEACHER_TOKENS", 1)
    with torch.no_grad():
        dense_hidden_states(model, rollout, masked)
    rows, slots, new = len(plan.prompt_lengths), plan.num_slots, plan.slot_width
    assert calls == [(torch.Size([rows, slots * new]), slots, "flex")]


def test_kept_prompt_keys_and_hidden_states_hold_only_the_prompt(model64):
    model = model64("qwen3")
    rollout = _rollout(model)
    learner = learner_hidden_states(model, rollout, shadow=True, keep_prompt_kv=True)
    kept = [tensor for pair in learner._packing.plan.prompt_kv.values() for tensor in pair] + [learner._prompt_hidden]
    per_row = learner_hidden_states(model, rollout, shadow=True, layout="per_row", keep_prompt_kv=True)
    kept_per_row = [tensor for pair in per_row._row_prompt_kv.values() for tensor in pair]
    assert len(kept) == 2 * model.config.num_hidden_layers + 1
    assert len(kept_per_row) == 2 * model.config.num_hidden_layers
    for tensor in kept:  # not a view into the packed row: the storage holds the prompt's columns only
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        assert tensor.shape[-2] == learner._packing.plan.prompt_width
    for tensor in kept_per_row:  # the longest prompt's columns, not the rows
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        assert tensor.shape[-2] == int(rollout.prompt_lengths.max()) < rollout.prompt_ids.shape[1] + NEW


def test_score_projects_in_chunks_with_the_same_result(model64, monkeypatch):
    """`score` against the sampler's log-probs, in chunks or not; only the completion tokens reach the head."""
    import lit_smd.losses.logprobs as logprobs_module
    from lit_smd.learner import score

    model = model64("qwen3")
    rollout = _rollout(model)  # completions cut short: padding in four of six rows
    projected, head = [], logprobs_module._apply  # the chunked pass, after token_logprobs_and_entropy's mask

    def spy(hidden, *args, **kwargs):
        projected.append(hidden.shape[:-1].numel())
        return head(hidden, *args, **kwargs)

    monkeypatch.setattr(logprobs_module, "_apply", spy)
    whole = score(model, rollout, shadow=True)
    chunked = score(model, rollout, shadow=True, chunk_size=5)
    assert projected == [int(rollout.completion_mask.sum())] * 2
    assert (whole - rollout.logprobs).abs().max() <= 1e-12
    assert (chunked - whole).abs().max() <= 1e-13
    with pytest.raises(ValueError, match="chunk_size"):
        score(model, rollout, chunk_size=0)


@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
def test_fused_blocks_give_the_checkpointed_blocks_gradients(model64, layout, monkeypatch):
    """The CPU kernel's own backward over each block's visible keys equals autograd through checkpointed SDPA
    blocks."""
    import lit_smd.kv.blocked as blocked
    import lit_smd.kv.packed as packed
    import lit_smd.kv.rows as rows

    model = model64("qwen3", sliding_window=9)  # a windowed dense prompt: fused blocks in both views
    rollout = _rollout(model)
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 256)
    monkeypatch.setattr(blocked, "VISIBLE_BLOCK", 5)
    fused_calls = []
    fused = blocked._VisibleBlocks.apply
    monkeypatch.setattr(blocked._VisibleBlocks, "apply", lambda *args: fused_calls.append(1) or fused(*args))
    results = []
    for use_fused in (True, False):
        if not use_fused:
            monkeypatch.setattr(rows, "fused_blocks", lambda *args: False)
            monkeypatch.setattr(packed, "fused_blocks", lambda *args: False)
        results.append(_logprobs_and_grads(
            model, rollout, lambda: learner_hidden_states(model, rollout, shadow=True, layout=layout).hidden
        ))  # fmt: skip
    assert fused_calls, "no block ran fused: the comparison would be vacuous"
    (logprobs, grads), (expected, expected_grads) = results
    assert (logprobs - expected).abs().max() <= 1e-12
    for name, grad in expected_grads.items():
        assert (grad - grads[name]).abs().max() <= 1e-10, name
