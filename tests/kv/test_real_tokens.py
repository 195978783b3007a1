"""`lit_smd.kv.real_tokens`: the decoder's MLPs run a learner pass's real tokens only, with the values and gradients
of running every position (float64), on every layout and view."""

import copy
import pickle

import pytest
import torch

import lit_smd.kv.attention as attention_module
from lit_smd.kv.attention import ensure_attention
from lit_smd.kv.packed import PackedPlan
from lit_smd.kv.real_tokens import mlp_on_real_tokens
from lit_smd.kv.shadow import AttentionPlan
from lit_smd.learner import dense_hidden_states, learner_hidden_states
from lit_smd.lora import LoraSettings, add_lora
from tests.test_families import build
from tests.test_learner import _float64_norms, _logprobs_and_grads, _rollout


def _mlp_rows(model) -> list[tuple[int, int]]:
    """The ``[rows, tokens]`` every MLP of ``model`` computes from now on (its ``down_proj``'s input)."""
    calls = []
    for layer in model.get_decoder().layers:
        layer.mlp.down_proj.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape[:2])))
    return calls


def _pair(peaky_model_factory, monkeypatch, family="qwen3"):
    """Two models with the same weights: the first runs its MLPs over the real tokens, the second (built with the
    install switched off) over every position."""
    unpadded = _float64_norms(peaky_model_factory(family))
    ensure_attention(unpadded)
    with monkeypatch.context() as patch:
        patch.setattr(attention_module, "mlp_on_real_tokens", lambda model: 0)
        every = _float64_norms(peaky_model_factory(family))
        ensure_attention(every)
    assert "forward" in unpadded.get_decoder().layers[0].mlp.__dict__
    assert "forward" not in every.get_decoder().layers[0].mlp.__dict__
    return unpadded, every


@pytest.mark.parametrize("layout", ["shared_prefix", "per_row"])
@pytest.mark.parametrize("shadow", [True, False])
def test_mlps_run_only_real_tokens_with_the_values_and_gradients_of_every_position(
    peaky_model_factory, monkeypatch, layout, shadow
):
    """Prompts of different lengths, completions cut short: each MLP call of the pass gets only the real tokens
    (``[1, M]`` with ``M`` the plan's real tokens, fewer than the rows' positions), and the log-probs and every
    parameter gradient equal those of running the MLPs over every position (float64, 1e-12)."""
    unpadded, every = _pair(peaky_model_factory, monkeypatch)
    rollout = _rollout(unpadded)
    assert not rollout.completion_mask.all()
    calls = _mlp_rows(unpadded)
    got = _logprobs_and_grads(unpadded, rollout, lambda: learner_hidden_states(
        unpadded, rollout, shadow=shadow, layout=layout).hidden)  # fmt: skip
    want = _logprobs_and_grads(every, rollout, lambda: learner_hidden_states(
        every, rollout, shadow=shadow, layout=layout).hidden)  # fmt: skip
    assert (got[0] - want[0]).abs().max() <= 1e-12
    assert got[1].keys() == want[1].keys()
    for name, grad in got[1].items():
        assert (grad - want[1][name]).abs().max() <= 1e-12, name
    real = int(rollout.prompt_mask.sum()) + int(rollout.completion_mask.sum())  # per row: each prompt once per row
    if layout == "shared_prefix":  # each group's prompt once
        real = int(rollout.prompt_mask[::3].sum()) + int(rollout.completion_mask.sum())
    assert calls and all(rows == 1 for rows, _ in calls) and {tokens for _, tokens in calls} == {real}


def test_the_dense_teacher_reuses_the_prompt_and_runs_real_slot_tokens_only(peaky_model_factory, monkeypatch):
    """SMD's dense teacher over kept prompt keys (slots only): the real completion tokens reach the MLPs, and its
    hidden states equal those of running every position."""
    unpadded, every = _pair(peaky_model_factory, monkeypatch)
    rollout = _rollout(unpadded)
    teacher = []
    for model in (unpadded, every):
        with torch.no_grad():
            masked = learner_hidden_states(model, rollout, shadow=True, keep_prompt_kv=True)
            calls = _mlp_rows(model)
            teacher.append(dense_hidden_states(model, rollout, masked))
    mask = rollout.completion_mask[..., None]
    assert (teacher[0] * mask - teacher[1] * mask).abs().max() <= 1e-12
    assert calls and {tokens for _, tokens in calls} >= {int(rollout.completion_mask.sum())}


def test_a_plain_call_and_a_checkpointed_recompute_run_their_own_rows(peaky_model_factory, monkeypatch):
    """After a learner pass a plain ``model(...)`` runs the MLPs over every position (no stale rows), with the same
    logits as the model that never unpads. Under activation checkpointing (transformers recomputes ``forward``, not
    ``__call__``) the recompute runs the real rows again though a plain call came between, with the same log-probs
    and gradients."""
    unpadded, every = _pair(peaky_model_factory, monkeypatch)
    rollout = _rollout(unpadded)
    learner_hidden_states(unpadded, rollout, shadow=True)
    calls = _mlp_rows(unpadded)
    ids = rollout.prompt_ids
    with torch.no_grad():
        assert torch.equal(unpadded(ids).logits, every(ids).logits)
    assert set(calls) == {tuple(ids.shape)}
    results = []
    for model in (unpadded, every):
        model.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def hidden(model=model):
            out = learner_hidden_states(model, rollout, shadow=True).hidden
            with torch.no_grad():
                model(ids)  # between the forward and its recompute
            return out

        calls.clear()
        results.append(_logprobs_and_grads(model, rollout, hidden))
        if model is unpadded:
            real = calls[0]
            layers = len(model.get_decoder().layers)
            assert real[0] == 1 and calls == [real] * layers + [tuple(ids.shape)] * layers + [real] * layers
    (got, got_grads), (want, want_grads) = results
    assert (got - want).abs().max() <= 1e-12
    for name, grad in got_grads.items():
        assert (grad - want_grads[name]).abs().max() <= 1e-12, name


def test_which_mlps_run_real_tokens(peaky_model_factory):
    """Dense MLPs, also under LoRA adapters, and idempotently; not a mixture of experts named MLP (GPT-OSS's router
    and expert tensors); the instance forward survives deep copies and pickling."""
    model = peaky_model_factory("qwen3")
    layers = len(model.get_decoder().layers)
    assert mlp_on_real_tokens(model) == layers == mlp_on_real_tokens(model)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        mlp = copied.get_decoder().layers[0].mlp
        assert mlp.__dict__["forward"].args == (mlp,)
        assert mlp_on_real_tokens(copied) == layers
    adapted = add_lora(peaky_model_factory("llama"), LoraSettings(r=2))
    assert mlp_on_real_tokens(adapted) == len(adapted.get_decoder().layers)
    gpt_oss, qwen3_moe = build("gpt_oss"), build("qwen3_moe")
    assert type(gpt_oss.get_decoder().layers[0].mlp).__name__ == "GptOssMLP" and mlp_on_real_tokens(gpt_oss) == 0
    phi3 = build("phi3")  # gate_up_proj
    assert mlp_on_real_tokens(qwen3_moe) == 0 and mlp_on_real_tokens(phi3) == len(phi3.get_decoder().layers)


def test_the_plans_real_tokens_by_hand():
    """Per row: the columns before each row's length. Packed: each row's prompt tokens, then each slot's tokens; a
    slots-only pass the slots alone; rows of another length: None."""
    rows = AttentionPlan(lengths=torch.tensor([3, 1])).real_tokens(4)
    assert rows.tolist() == [[True, True, True, False], [True, False, False, False]]
    plan = PackedPlan(prompt_lengths=torch.tensor([2, 1]), prompt_width=2, num_slots=2, slot_width=3,
                      slot_lengths=torch.tensor([[3, 1], [0, 2]]))  # fmt: skip
    assert plan.real_tokens(8).int().tolist() == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 1, 1, 0]]
    plan.prompt_kv[0] = (torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 4))
    assert plan.for_slots().real_tokens(6).int().tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]]
    assert plan.real_tokens(7) is None


def test_the_noted_rows_are_the_threads_own():
    """Rows noted by one thread's layer are not another thread's: a model run on a second thread meanwhile sees none."""
    import threading

    import lit_smd.kv.real_tokens as real_tokens

    plan = AttentionPlan(lengths=torch.tensor([3, 1]))
    real_tokens.set_layer_rows(plan, (2, 4))
    seen = []
    thread = threading.Thread(target=lambda: seen.append(real_tokens._CURRENT.rows))
    thread.start()
    thread.join(timeout=10)
    assert seen == [None] and real_tokens._CURRENT.rows.index.tolist() == [0, 1, 2, 4]
    real_tokens.set_layer_rows(None, (2, 4))
    assert real_tokens._CURRENT.rows is None
