"""`lit_smd.fsdp.FSDP2Strategy` in this process (one rank, gloo): fast checks of the FSDP2 code paths.

With one rank every shard is the whole tensor, so a sharded fit must train exactly like the same fit without a
strategy; what this exercises is the machinery: ``fully_shard`` per layer and root, steps run as root forwards,
whole-model gathers for rollouts and evaluation sampling, root gathers for the reference's scoring, the entropy probe,
the mixed-precision policy and the export from a gathered state dict. The 2-rank checks (gradient reduce-scatter,
sharded checkpoints) are in `test_fsdp_training.py` (slow).
"""

from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lit_smd.callbacks import GenerationEval
from lit_smd.datamodules import DistillDataModule, RolloutDataModule, SupervisedDataModule
from lit_smd.fsdp import FSDP2Strategy, shard_model
from lit_smd.kv import RecentWindow
from lit_smd.lora import LoraSettings, add_lora
from lit_smd.models import load_causal_lm
from lit_smd.modules import DistillModule, GRPOModule, SFTModule
from lit_smd.tasks import key_value_retrieval
from lit_smd.tiny import build_tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:.*(sanity|num_workers|tensorboardX).*")]


@pytest.fixture(autouse=True)
def _own_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lightning's launcher writes these for the (here: no) child ranks; restore them, and close the group after."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _model(tokenizer, seed: int = 0) -> torch.nn.Module:
    return build_tiny_model("qwen3", tokenizer=tokenizer, seed=seed, initializer_range=0.35)


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights, sharded ones gathered."""
    state = model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _trainer(tmp_path: Path, strategy: object = "auto", **kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **kwargs,
    )  # fmt: skip


def test_grpo_under_fsdp2_trains_like_one_device(tokenizer, tmp_path, monkeypatch):
    import lit_smd.modules._grpo_smd as grpo_smd

    layouts = []  # (sharded, shadow, layout) of every learner pass
    learner = grpo_smd.learner_hidden_states

    def spy(model, rollout, **kwargs):
        layouts.append((isinstance(model, FSDPModule), kwargs["shadow"], kwargs["layout"]))
        return learner(model, rollout, **kwargs)

    monkeypatch.setattr(grpo_smd, "learner_hidden_states", spy)
    prompts = key_value_retrieval(8, num_pairs=3)
    finals, modules = [], []
    for strategy in ("auto", FSDP2Strategy(process_group_backend="gloo")):
        module = GRPOModule(
            _model(tokenizer), mode="smd", compressor=RecentWindow(12, sinks=2), kl_coef=0.1, beta=0.05,
            optimizer=_sgd,
        )  # fmt: skip
        data = RolloutDataModule(
            prompts, tokenizer, [lambda prompts, completions, **kw: [len(c) % 3 / 2 for c in completions]],
            use_chat_template=False, prompts_per_step=2, num_generations=3, max_new_tokens=4, val_dataset=prompts,
            eval_batch_size=2,
        )  # fmt: skip
        callback = GenerationEval(num_samples=2, max_new_tokens=4, use_compressor=True)
        trainer = _trainer(tmp_path, strategy, callbacks=[callback], val_check_interval=2, limit_val_batches=1)
        trainer.fit(module, data)
        assert "eval/accuracy" in trainer.callback_metrics  # generation-based evaluation ran on the gathered policy
        finals.append(_full(module.policy))
        modules.append(module)
    assert not isinstance(modules[0].policy, FSDPModule)
    assert isinstance(modules[1].policy, FSDPModule) and isinstance(modules[1].reference, FSDPModule)
    # SMD's shadow view keeps the shared-prefix layout under FSDP2 (every row of the one rank can share its prompt).
    assert (True, True, "shared_prefix") in layouts and (True, True, "per_row") not in layouts
    moved = max((finals[0][k] - v).abs().max().item() for k, v in _model(tokenizer).state_dict().items())
    assert moved > 1e-3
    for name, value in finals[0].items():
        torch.testing.assert_close(finals[1][name], value, rtol=1e-5, atol=1e-6)


def test_distill_probe_under_fsdp2_equals_the_unsharded_probe(tokenizer, tmp_path):
    prompts = key_value_retrieval(8, num_pairs=3)
    data = DistillDataModule(prompts, tokenizer, batch_size=2, use_chat_template=False, num_probe_prompts=2)
    module = DistillModule(_model(tokenizer), _model(tokenizer, seed=1), prefix_source="mix", optimizer=_sgd,
                           max_new_tokens=4)  # fmt: skip
    _trainer(tmp_path, FSDP2Strategy(process_group_backend="gloo")).fit(module, data)
    assert isinstance(module.student, FSDPModule) and isinstance(module.teacher, FSDPModule)
    sharded = module.probe(data.probe_batch())
    weights = _full(module.student)
    plain = DistillModule(_model(tokenizer), _model(tokenizer, seed=1), max_new_tokens=4)
    plain.student.load_state_dict(weights)
    expected = plain.probe(data.probe_batch())
    assert sharded.entropy == pytest.approx(expected.entropy, rel=1e-5)
    assert sharded.response_length == expected.response_length


class _DtypeSFT(SFTModule):
    """Records the dtype of the lm_head weight the step computes with."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.compute_dtypes.append(self.policy.get_output_embeddings().weight.dtype)
        return super().training_step(batch, batch_idx)


def test_sft_mixed_precision_policy_and_export_from_gathered_weights(tokenizer, tmp_path):
    rows = key_value_retrieval(8, num_pairs=3)
    module = _DtypeSFT(_model(tokenizer), optimizer=_sgd, export_dir=str(tmp_path / "export"))
    module.compute_dtypes = []
    data = SupervisedDataModule(rows, tokenizer, batch_size=2, use_chat_template=False)
    strategy = FSDP2Strategy(param_dtype="bfloat16", reduce_dtype="float32", process_group_backend="gloo")
    _trainer(tmp_path, strategy).fit(module, data)
    assert module.compute_dtypes == [torch.bfloat16] * 2  # gathered in the policy's param_dtype
    stored = _full(module.policy)
    assert all(value.dtype == torch.float32 for value in stored.values())  # the sharded weights stay float32
    exported = load_causal_lm(str(tmp_path / "export"))
    assert type(exported).__name__ == "Qwen3ForCausalLM" and exported.config.architectures == ["Qwen3ForCausalLM"]
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, stored[name], rtol=0, atol=0)


def test_lora_is_refused_under_fsdp2_before_any_sharding(tokenizer):
    model = add_lora(_model(tokenizer), LoraSettings(r=2, alpha=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="lora with FSDP2Strategy is not supported"):
        shard_model(model, FSDP2Strategy())  # raised before the strategy's device mesh is needed
    assert not isinstance(model, FSDPModule)


def test_a_plain_model_parallel_strategy_is_refused_at_configure_model(tokenizer, tmp_path):
    rows = key_value_retrieval(4, num_pairs=3)
    data = SupervisedDataModule(rows, tokenizer, batch_size=2, use_chat_template=False)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    with pytest.raises(ValueError, match=r"trainer\.strategy=ModelParallelStrategy: .*lit_smd\.fsdp\.FSDP2Strategy"):
        _trainer(tmp_path, strategy).fit(SFTModule(_model(tokenizer)), data)
