"""LoRA (peft) on the GRPO policy and the distillation student: the shadow-mask replay stays exact with adapters, the
reference is the base model (adapters disabled, no second copy), only adapters are trained, the export is merged."""

import sys
from pathlib import Path

import bitsandbytes as bnb
import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_smd.cli import main
from lit_smd.datamodules import DistillDataModule, ScoredRollout
from lit_smd.kv import H2O, PrefillThenDecode, SnapKV
from lit_smd.learner import score
from lit_smd.lora import LoraSettings, add_lora, has_lora, lora_disabled
from lit_smd.models import load_causal_lm
from lit_smd.modules import DistillModule, GRPOModule
from lit_smd.rollout import Rollout, generate
from lit_smd.tasks import arithmetic, key_value_retrieval
from lit_smd.tiny import build_tiny_model, save_tiny_checkpoint

LORA = LoraSettings(r=4, alpha=8.0)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def randomize_adapters(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> None:
    """Draw every LoRA ``B`` (zero at init) at random, so that the adapters change the model's outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)


def adapter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}


def compressed_rollout(model, tokenizer, *, num_prompts=2, group=2, max_new_tokens=10, seed=0) -> Rollout:
    prompts = list(key_value_retrieval(num_prompts, num_pairs=4, seed=seed)["prompt"])
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    compressor = PrefillThenDecode(SnapKV(12, window=2), H2O(12, window=2))
    return generate(
        model, encoded["input_ids"], encoded["attention_mask"], compressor=compressor, max_new_tokens=max_new_tokens,
        num_generations=group, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def storages(module: torch.nn.Module) -> set[int]:
    """Distinct storages of every parameter and buffer: shared tensors count once."""
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


def test_lora_settings_and_adapters_validate():
    for kwargs, match in (
        ({"r": 0}, "lora.r"), ({"alpha": 0.0}, "lora.alpha"), ({"dropout": 1.0}, "lora.dropout"),
        ({"target_modules": []}, "lora.target_modules"), ({"target_modules": "q_proj"}, "lora.target_modules"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            LoraSettings(**kwargs)
    model = build_tiny_model("qwen3", vocab_size=64)
    assert not has_lora(model)
    with pytest.raises(ValueError, match="no LoRA adapters"), lora_disabled(model):
        pass
    add_lora(model, LORA)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(model, LORA)


def test_lora_settings_survive_a_weights_only_checkpoint_load(tiny_model, tmp_path):
    module = GRPOModule(tiny_model, mode="smd", compressor=H2O(8, window=2), lora=LORA)
    torch.save({"hyper_parameters": dict(module.hparams)}, tmp_path / "hparams.ckpt")
    assert torch.load(tmp_path / "hparams.ckpt", weights_only=True)["hyper_parameters"]["lora"] == LORA


def test_lora_and_8bit_optimizer_overlays_instantiate_through_the_cli(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-smd"])
    policy = save_tiny_checkpoint(tmp_path / "policy", tokenizer=tokenizer)
    cli = main(
        [
            "--config", str(CONFIGS / "grpo/quickstart_cpu.yaml"), "--config", str(CONFIGS / "lora/r16.yaml"),
            "--config", str(CONFIGS / "optim/adamw8bit.yaml"), "--trainer.logger", "false",
            "--model.init_args.policy", str(policy), "--data.init_args.tokenizer", str(policy),
        ],
        run=False,
    )  # fmt: skip
    module = cli.model
    module.configure_model()
    assert module.lora == LoraSettings(r=16, alpha=32.0, dropout=0.0, target_modules="all-linear")
    adapters = adapter_names(module.policy)
    assert module.policy.get_parameter(sorted(adapters)[0]).shape[0] == 16  # lora_A: [r, in]
    optimizer = module.configure_optimizers()
    assert type(optimizer) is bnb.optim.AdamW8bit and optimizer.defaults["lr"] == 5e-4
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(adapters)


@pytest.mark.parametrize("module_class", [GRPOModule, DistillModule])
def test_lora_dropout_with_disable_dropout_is_rejected(module_class, tiny_model):
    kwargs = {"mode": "smd", "compressor": H2O(8, window=2)} if module_class is GRPOModule else {"teacher": tiny_model}
    with pytest.raises(ValueError, match="lora.dropout=0.1 would be zeroed by disable_dropout=True"):
        module_class(tiny_model, lora=LoraSettings(dropout=0.1), **kwargs)
    with pytest.raises(ValueError, match="lora must be a lit_smd.lora.LoraSettings"):
        module_class(tiny_model, lora={"r": 4}, **kwargs)


def test_shadow_replay_with_adapters_is_exact_in_float64(peaky_model_factory, family, tokenizer):
    """The learner's masked view of an adapted policy reproduces the log-probs its compressed rollout recorded."""
    module = GRPOModule(peaky_model_factory(family), mode="smd", compressor=H2O(12, window=2), lora=LORA)
    randomize_adapters(module.policy)
    rollout = compressed_rollout(module.policy, tokenizer)
    with torch.no_grad():
        learner = module(rollout)  # [B, N], shadow-masked view, chunked lm_head
        with lora_disabled(module.policy):
            base = module(rollout)
    mask = rollout.completion_mask
    gap = (learner - rollout.logprobs)[mask].abs().max().item()
    assert gap < 1e-10, gap
    assert (base - rollout.logprobs)[mask].abs().max().item() > 1e-2, "the adapters do not change the model"
    dense = score(module.policy, rollout, shadow=False, temperature=module.temperature)
    assert (dense - rollout.logprobs)[mask].abs().max().item() > 1e-2, "nothing evicted: the test proves nothing"


def test_reference_is_the_base_model_with_adapters_disabled(tmp_path, tokenizer):
    path = save_tiny_checkpoint(tmp_path / "policy", tokenizer=tokenizer, initializer_range=0.35)
    module = GRPOModule(str(path), mode="smd", compressor=H2O(12, window=2), beta=0.1, lora=LORA, model_dtype="float64")
    module.configure_model()
    assert module.reference is None and module.reference_is_base
    randomize_adapters(module.policy)
    rollout = compressed_rollout(module.policy, tokenizer)
    experience = module.make_experience(
        ScoredRollout(rollout, torch.arange(len(rollout), dtype=torch.float64), num_generations=2)
    )

    base = load_causal_lm(str(path), dtype="float64")  # a second, independently loaded copy of the base weights
    expected = score(base, rollout, shadow=True, temperature=module.temperature)
    torch.testing.assert_close(experience.ref_logprobs, expected, rtol=0, atol=1e-12)
    mask = rollout.completion_mask
    assert (experience.ref_logprobs - rollout.logprobs)[mask].abs().max() > 1e-2, "adapters had no effect"
    assert all(p.requires_grad for name, p in module.policy.named_parameters() if name in adapter_names(module.policy))
    with torch.no_grad():  # the adapters are back on after scoring the reference
        assert (module(rollout) - rollout.logprobs)[mask].abs().max() < 1e-10


def test_only_adapters_get_gradients_and_optimizer_slots(tiny_model, tokenizer):
    base_count = sum(p.numel() for p in tiny_model.parameters())
    module = GRPOModule(tiny_model, mode="smd", compressor=H2O(12, window=2), lora=LORA)
    adapters = adapter_names(module.policy)
    # 2 layers x 7 linear layers (q, k, v, o, gate, up, down), each an A and a B; the lm_head is not adapted.
    assert len(adapters) == 2 * 7 * 2
    assert {name for name, p in module.policy.named_parameters() if p.requires_grad} == adapters
    optimizer = module.configure_optimizers()
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for name, p in module.policy.named_parameters() if name in adapters}

    randomize_adapters(module.policy)  # with B = 0 the A weights would get no gradient
    rollout = compressed_rollout(module.policy, tokenizer, max_new_tokens=6)
    module.smd_kl(rollout, rollout.completion_mask).loss.backward()
    with_grad = {name for name, p in module.policy.named_parameters() if p.grad is not None}
    assert with_grad == adapters
    assert all(module.policy.get_parameter(name).grad.abs().sum() > 0 for name in adapters)
    lora_params = sum(p.numel() for name, p in module.policy.named_parameters() if name in adapters)
    assert sum(p.numel() for p in module.policy.parameters()) == base_count + lora_params


def test_grpo_fit_with_lora_trains_only_adapters_and_keeps_one_model_copy(tiny_model_factory, tokenizer):
    def fit(lora: LoraSettings | None) -> tuple[GRPOModule, dict[str, torch.Tensor]]:
        policy = tiny_model_factory(initializer_range=0.35)
        adamw = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)  # noqa: E731
        module = GRPOModule(policy, mode="smd", compressor=H2O(12, window=2), beta=0.1, lora=lora, optimizer=adamw)
        module.configure_model()
        rollout = compressed_rollout(module.policy, tokenizer, max_new_tokens=6)
        experience = module.make_experience(
            ScoredRollout(rollout, torch.tensor([0.0, 1.0, 1.0, 0.0]), num_generations=2)
        )
        before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
        L.Trainer(
            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
            enable_model_summary=False,
        ).fit(module, DataLoader([experience, experience], batch_size=None))  # fmt: skip
        return module, before

    module, before = fit(LORA)
    changed = {name for name, p in module.policy.named_parameters() if not torch.equal(p, before[name])}
    adapters = adapter_names(module.policy)
    assert changed and changed <= adapters, sorted(changed - adapters)
    assert any(".lora_B." in name for name in changed)
    # One model in memory: the module's tensors are the policy's (plus its adapters); no reference copy.
    assert module.reference is None
    assert storages(module) == storages(module.policy)
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in module.policy.parameters())
    full, _ = fit(None)  # without LoRA, beta > 0 deep-copies the policy into a frozen reference
    assert full.reference is not None and not storages(full.reference) & storages(full.policy)  # a second copy
    assert len(storages(full.reference)) == len(storages(full.policy))


def test_distill_fit_with_lora_trains_only_adapters_and_exports_merged_weights(tokenizer, tmp_path):
    student = build_tiny_model("qwen3", tokenizer=tokenizer)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    sgd = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    module = DistillModule(
        student, teacher, max_new_tokens=4, optimizer=sgd, lora=LORA, export_dir=str(tmp_path / "export")
    )
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    data = DistillDataModule(arithmetic(8, seed=3), tokenizer, batch_size=2, use_chat_template=False)
    L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
        enable_model_summary=False,
    ).fit(module, data)  # fmt: skip

    changed = {name for name, p in student.named_parameters() if not torch.equal(p, before[name])}
    adapters = adapter_names(student)
    assert changed and changed <= adapters, sorted(changed - adapters)
    exported = load_causal_lm(str(tmp_path / "export"), dtype="float32")
    assert not has_lora(exported)
    assert exported.state_dict().keys() == build_tiny_model("qwen3", tokenizer=tokenizer).state_dict().keys()
    rollout = compressed_rollout(student, tokenizer, max_new_tokens=6)
    with torch.no_grad():
        torch.testing.assert_close(score(exported, rollout), score(student, rollout), rtol=0, atol=1e-5)
        with lora_disabled(student):
            assert (score(exported, rollout) - score(student, rollout)).abs().max() > 1e-5, "training moved nothing"
