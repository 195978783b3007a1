"""`generate_prefixes`: the stop tokens of a distillation prefix are the data side's and the model's own."""

import torch

from lit_smd.datamodules.distill import PromptBatch
from lit_smd.modules import _distill_prefixes
from lit_smd.tiny import build_tiny_model


def test_the_models_configured_eos_stops_prefixes_even_when_it_is_token_zero(monkeypatch):
    """GPT-NeoX / Pythia end sequences with token id 0: it must not be dropped as falsy."""
    model = build_tiny_model("qwen3", vocab_size=32, num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1,
                             head_dim=8, intermediate_size=32)  # fmt: skip
    model.generation_config.eos_token_id = [0, 7]
    prompts = PromptBatch(torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.bool), torch.tensor([0]), (2,), 1)
    seen = {}

    def fake_generate(*args, **kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(_distill_prefixes, "generate", fake_generate)
    _distill_prefixes.generate_prefixes(model, prompts, 4, 1.0, None)
    assert seen["eos_token_id"] == [0, 2, 7]
    model.generation_config.eos_token_id = None
    _distill_prefixes.generate_prefixes(model, prompts, 4, 1.0, None)
    assert seen["eos_token_id"] == [2]
