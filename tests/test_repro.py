"""The miniature reproduction (benchmarks/repro/): every kind of cell it runs is a valid `lit-smd fit` command, the
held-out evaluation agrees with an independent decode, the tables aggregate what the cells measured, and a folder of
results is never silently reused for other settings.

The reproduction itself takes most of an hour (docs/results/README.md); these tests run none of its training.
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from lit_smd.cli import main
from lit_smd.models import build_tiny_tokenizer, load_causal_lm, load_tokenizer, save_tiny_checkpoint
from lit_smd.rewards import math_answer_reward

REPRO = Path(__file__).resolve().parents[1] / "benchmarks" / "repro"


@pytest.fixture(scope="module")
def repro():
    """The reproduction's modules (`smd_table`, `distill_table`, `_runner`, `_evaluate`) by name."""
    sys.path.insert(0, str(REPRO))
    try:
        import _evaluate
        import _runner
        import distill_table
        import smd_table

        yield {"smd": smd_table, "distill": distill_table, "runner": _runner, "evaluate": _evaluate}
    finally:
        sys.path.remove(str(REPRO))


def test_every_kind_of_cell_is_a_valid_cli_command(repro, tmp_path):
    smd, distill = repro["smd"], repro["distill"]
    save_tiny_checkpoint(smd.warmup_policy(tmp_path, 0))
    save_tiny_checkpoint(distill.teacher_policy(tmp_path), hidden_size=96, num_layers=2, num_heads=6, seed=1)
    for cell in distill.distill_cells(tmp_path, [0], list(distill.CELLS), steps=3):
        save_tiny_checkpoint(tmp_path / "policies" / cell.name)
    cells = smd.grpo_cells(tmp_path, [0], [0.5, 0.3], list(smd.SELECTIONS), steps=3)
    assert len(cells) == 1 + 2 * (3 * 2 + len(smd.LAMBDAS) + 2)  # dense; per budget naive+sparse_rl x 3, smd x 5
    assert len({cell.name for cell in cells}) == len(cells)
    cells += distill.distill_cells(tmp_path, [0], list(distill.CELLS), steps=3)
    cells += distill.rl_cells(tmp_path, [0], list(distill.CELLS), steps=3)
    cells += [smd.warmup_cell(tmp_path, 0, max_steps=3), distill.teacher_cell(tmp_path, max_steps=3)]
    checked = set()
    for cell in cells:
        meta = cell.meta
        kind = (meta.get("kind"), meta.get("mode"), meta.get("selection"), meta.get("cell", "")[:7])
        if kind in checked:
            continue
        checked.add(kind)
        assert cell.argv[0] == "fit"
        cli = main(cell.argv[1:], run=False)  # parse and instantiate only (the subcommand is implied)
        module = cli.model
        if meta.get("mode"):
            assert module.mode == meta["mode"]
            assert (module.compressor is None) == (meta["mode"] == "dense")
            if meta["mode"] == "smd":
                assert module.kl_coef == meta["lambda"]
            if meta.get("selection") == "recent":
                assert type(module.compressor).__name__ == "RecentWindow"
        if meta.get("kind") == "distill":
            assert module.prefix_source == meta["prefix"]
            curriculum = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "EntropyCurriculum"]
            assert bool(curriculum) == meta["cell"].endswith("+curriculum")
        assert cli.trainer.max_steps == 3
    assert len(checked) >= 8


def test_greedy_accuracy_matches_an_independent_hf_decode(repro, tmp_path):
    evaluate = repro["evaluate"]
    path = save_tiny_checkpoint(tmp_path / "policy", seed=3)
    model, tokenizer = load_causal_lm(str(path), dtype=torch.float32), load_tokenizer(str(path))
    settings = evaluate.EvalSettings(num_prompts=12, num_samples=2, batch_size=5)
    prompts, answers = evaluate.heldout_retrieval(settings)
    reference = load_causal_lm(str(path), dtype=torch.float32, attn_implementation="eager")
    texts = []
    for prompt in prompts:  # transformers' own greedy decode, one prompt at a time: no padding involved
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = reference.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    expected = math_answer_reward(prompts, texts, answers)
    result = evaluate.evaluate_policy(model, tokenizer, settings)
    assert result["greedy_accuracy"] == pytest.approx(sum(expected) / len(expected))
    assert result["length"] == 2.0 and result["visible_fraction"] == 1.0
    assert 0 <= result["pass@1"] <= result["pass@2"] <= 1
    assert result["pass@1"] == pytest.approx(result["accuracy"])  # unbiased pass@1 is the mean success
    vocab = len(build_tiny_tokenizer())
    assert 0 < result["entropy"] <= torch.log(torch.tensor(float(vocab))).item()


def _result(name: str, meta: dict, scalars: dict, accuracy: float) -> dict:
    return {"cell": {"name": name, "meta": meta, "argv": [], "eval_settings": {}}, "scalars": scalars,
            "eval": {"accuracy": accuracy, "greedy_accuracy": accuracy / 2}}  # fmt: skip


def test_smd_table_aggregates_seeds(repro):
    smd = repro["smd"]
    reward = [[step, 0.0 if step < 8 else 1.0] for step in range(10)]  # last 20%: steps 8, 9
    meta = {"mode": "naive", "lambda": None, "budget": 0.5, "selection": "recent"}
    results = {
        "a": _result("a", {**meta, "seed": 0}, {"rollout/reward_mean": reward,
                                                "mismatch/logprob_abs_diff_max": [[0, 2.0], [1, 5.0]]}, 0.5),
        "b": _result("b", {**meta, "seed": 1}, {"rollout/reward_mean": reward}, 0.7),
    }  # fmt: skip
    initial = {"recent-b0.5-seed0": {"accuracy": 0.25}, "recent-b0.5-seed1": {"accuracy": 0.45}}
    table, (row,) = smd.summarise(results, initial, steps=10)
    assert row["reward_last"] == [1.0, 1.0]
    assert row["delta"] == pytest.approx([0.25, 0.25])
    assert row["mismatch_max"] == [5.0, None]
    assert (
        "| 50% | recent | naive | - | 2 | 1.000 ± 0.000 | 0.350 ± 0.100 | 0.600 ± 0.100 | 0.250 ± 0.000 "
        "| 0.300 ± 0.050 | - | 5.000 | - | - |"
    ) in table


def test_run_cells_refuses_results_of_other_settings(repro, tmp_path):
    runner = repro["runner"]
    cell = runner.Cell("x", ["fit", "--trainer.max_steps", "3"], eval_settings={"num_prompts": 64}, meta={"seed": 0})
    done = tmp_path / "cells" / "x.json"
    done.parent.mkdir()
    for other in ({"argv": ["fit", "--trainer.max_steps", "5"]}, {"eval_settings": {"num_prompts": 256}}):
        stored = {"cell": {**asdict(cell), **other}}
        done.write_text(json.dumps(stored))
        with pytest.raises(ValueError, match="other settings"):
            runner.run_cells([cell], tmp_path, jobs=1)
        assert json.loads(done.read_text()) == stored  # left as it was
    stored = {"cell": {**asdict(cell), "meta": {"seed": 0, "placed": "elsewhere"}}}  # placement is not a setting
    done.write_text(json.dumps(stored))
    assert runner.run_cells([cell], tmp_path, jobs=1) == {"x": stored}  # done: not rerun
