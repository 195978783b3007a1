"""The miniature reproduction (benchmarks/repro/): every kind of cell it runs is a valid `lit-smd fit` command, the
held-out evaluation agrees with an independent decode, the tables aggregate what the cells measured, and a folder of
results is never silently reused for other settings.

The reproduction itself takes most of an hour (docs/results/README.md); these tests run none of its training.
"""

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from lit_smd.cli import main
from lit_smd.kv import RecentWindow
from lit_smd.losses.sparse_rl import sparse_rl_correction
from lit_smd.models import load_causal_lm, load_tokenizer
from lit_smd.rewards import chain_hops_reward, chain_walk_reward, math_answer_reward
from lit_smd.tiny import build_tiny_tokenizer, save_tiny_checkpoint

REPRO = Path(__file__).resolve().parents[1] / "benchmarks" / "repro"


@pytest.fixture(scope="module")
def repro():
    """The reproduction's modules (`smd_table`, `distill_table`, `gpu_table`, `_runner`, `_evaluate`, `_stats`)."""
    sys.path.insert(0, str(REPRO))
    try:
        import _evaluate
        import _runner
        import _stats
        import distill_table
        import gpu_table
        import smd_table

        yield {"smd": smd_table, "distill": distill_table, "gpu": gpu_table, "runner": _runner,
               "evaluate": _evaluate, "stats": _stats}  # fmt: skip
    finally:
        sys.path.remove(str(REPRO))
        smd_table.configure("retrieval")  # module state of the invocation: back to the default


@pytest.mark.parametrize("task", ["retrieval", "chain", "walk"])
def test_every_kind_of_cell_is_a_valid_cli_command(repro, tmp_path, task):
    smd, distill = repro["smd"], repro["distill"]
    smd.configure(task)
    save_tiny_checkpoint(smd.warmup_policy(tmp_path, 0))
    save_tiny_checkpoint(distill.teacher_policy(tmp_path), hidden_size=96, num_layers=2, num_heads=6, seed=1)
    if task == "walk":  # its distillation students are the walk warm-up stopped early
        save_tiny_checkpoint(distill.student_policy(tmp_path, 0))
    if task in ("chain", "walk"):  # their warm-ups start from the retrieval ones
        save_tiny_checkpoint(tmp_path / "policies" / "retrieval-warmup-seed0")
        save_tiny_checkpoint(tmp_path / "policies" / "teacher-retrieval", hidden_size=96, num_heads=6, seed=1)
    for cell in distill.distill_cells(tmp_path, [0], list(distill.CELLS), steps=3):
        save_tiny_checkpoint(tmp_path / "policies" / cell.name)
    cells = smd.grpo_cells(tmp_path, [0], [0.5, 0.3], list(smd.SELECTIONS), steps=3)
    # dense; at 50%: SnapKV naive + sparse_rl + smd x 3 lambdas, recent and random naive + sparse_rl + smd; at 70%:
    # SnapKV only
    assert len(cells) == 1 + (2 + len(smd.LAMBDAS)) + 2 * 3 + (2 + len(smd.LAMBDAS))
    assert len({cell.name for cell in cells}) == len(cells)
    assert all(c.meta["selection"] == "snapkv" for c in cells if c.meta.get("budget") == 0.3)
    cells += distill.distill_cells(tmp_path, [0], list(distill.CELLS), steps=3)
    rl = distill.rl_cells(tmp_path, [0], list(distill.CELLS), steps=3)
    assert len(rl) == 2 * (1 + len(distill.CELLS))  # dense GRPO and SMD-GRPO after each cell and after none
    cells += rl + [cell for stage in smd.warmup_stages(tmp_path, [0], max_steps=3) for cell in stage]
    cells += [distill.teacher_cell(tmp_path, max_steps=3)]
    if task == "walk":  # weak students: the walk warm-up stopped early
        student = smd.warmup_cell(tmp_path, 0, 3, stage="student")
        assert student.argv[student.argv.index("--model.init_args.export_dir") + 1] == str(
            distill.student_policy(tmp_path, 0))
        assert all(c.argv[c.argv.index("--model.init_args.student") + 1] == str(distill.student_policy(tmp_path, 0))
                   for c in cells if c.meta.get("kind") == "distill")  # fmt: skip
        cells += [student]
    if task in ("chain", "walk"):
        cells += [distill.teacher_cell(tmp_path, max_steps=3, stage="retrieval")]
        assert [c.name for c in smd.warmup_stages(tmp_path, [0])[0]] == ["retrieval-warmup-seed0"]
    checked = set()
    for cell in cells:
        meta = cell.meta
        kind = (meta.get("kind"), meta.get("mode"), meta.get("rl"), meta.get("selection"), meta.get("cell", "")[:7],
                cell.name.split("-")[0])
        if kind in checked:
            continue
        checked.add(kind)
        assert cell.argv[0] == "fit"
        assert cell.eval_settings["task"] == task
        dataset = {"chain": "multi_hop_chain", "walk": "chain_walk"}.get(task, "key_value_retrieval")
        if meta.get("kind") in ("warmup", "teacher", "student") and not cell.name.startswith(
            ("retrieval", "teacher-retrieval")
        ):
            assert cell.argv[cell.argv.index("--model.init_args.export_dir") + 1].startswith(str(tmp_path))
            cli = main(cell.argv[1:], run=False)
            assert cli.datamodule.dataset == dataset
            assert cli.datamodule.append_eos == (task == "walk")  # the free-length task trains its EOS
            continue
        cli = main(cell.argv[1:], run=False)  # parse and instantiate only (the subcommand is implied)
        module = cli.model
        if meta.get("mode") or meta.get("rl"):
            mode = meta.get("mode") or meta["rl"]
            assert module.mode == mode
            assert (module.compressor is None) == (mode == "dense")
            if mode == "smd" and "lambda" in meta:
                assert module.kl_coef == meta["lambda"]
            if meta.get("selection") == "recent":
                assert type(module.compressor).__name__ == "RecentWindow"
            assert cli.datamodule.dataset == dataset
            if task == "walk":  # lengths free: the cap is twice the longest walk, the reward the whole walk
                walk = smd.TASKS["walk"]["eval"]
                assert cli.datamodule.max_new_tokens == walk["max_new_tokens"] == 2 * walk["num_hops"]
                assert cli.datamodule.dataset_kwargs["max_hops"] == walk["num_hops"]
            if task == "chain":
                chain = smd.TASKS["chain"]["eval"]  # the calibrated setting (docs/results/chain/calibration.md)
                assert cli.datamodule.max_new_tokens == chain["max_new_tokens"] == chain["num_hops"]
                kwargs = cli.datamodule.dataset_kwargs
                assert (kwargs["num_hops"], kwargs["num_nodes"]) == (chain["num_hops"], chain["num_nodes"])
        if meta.get("kind") == "distill":
            assert module.prefix_source == meta["prefix"]
            curriculum = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "EntropyCurriculum"]
            assert bool(curriculum) == meta["cell"].endswith("+curriculum")
            if curriculum and task == "chain":
                assert curriculum[0].lengths == [1, 2, smd.TASKS["chain"]["eval"]["max_new_tokens"]]
            if curriculum and task == "walk":  # up to the longest fixed length, the plain mix's
                assert curriculum[0].lengths == [4, 8, smd.TASKS["walk"]["eval"]["max_new_tokens"]]
            if task == "walk" and not curriculum:
                assert module.max_new_tokens == smd.TASKS["walk"]["eval"]["max_new_tokens"]
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


def test_t_quantile_and_interval_against_hand_computed_values(repro):
    stats = repro["stats"]
    assert stats.t_quantile(0.95, 1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-12)  # Cauchy: tan(pi p / 2)
    assert stats.t_quantile(0.95, 2) == pytest.approx(math.sqrt(2 * 0.95**2 / (1 - 0.95**2)), rel=1e-12)  # closed form
    assert stats.t_quantile(0.95, 4) == pytest.approx(2.776, abs=5e-4)  # the printed tables
    assert stats.t_quantile(0.95, 9) == pytest.approx(2.262, abs=5e-4)
    assert stats.t_quantile(0.99, 5) == pytest.approx(4.032, abs=5e-4)
    interval = stats.mean_interval([0.2, None, 0.4, 0.6])  # s = 0.2, n = 3: 4.302653 * 0.2 / sqrt(3) = 0.496828
    assert interval.n == 3 and interval.mean == pytest.approx(0.4)
    assert interval.half_width == pytest.approx(0.496828, abs=1e-6)
    assert stats.mean_interval([0.7]).half_width is None and stats.mean_interval([None]) is None
    with pytest.raises(ValueError, match="dof must be an integer >= 1"):
        stats.t_quantile(0.95, 0)


def test_p_values_and_holm_against_hand_computed_values(repro):
    stats = repro["stats"]
    # differences [1, 2, 3]: t = 2 / (1 / sqrt 3) = 3.4641 at 2 dof; P(|T| > t) = 1 - t / sqrt(2 + t^2) (closed form)
    t = 2 * math.sqrt(3)
    assert stats.t_p_value([1.0, 2.0, 3.0]) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12)
    # 1 dof (Cauchy): P(|T| > t) = 1 - 2 atan(t) / pi; differences [1, 3]: t = 2 / (sqrt 2 / sqrt 2) = 2
    assert stats.t_p_value([1.0, 3.0]) == pytest.approx(1 - 2 * math.atan(2) / math.pi, rel=1e-12)
    assert stats.t_p_value([0.5]) is None and stats.t_p_value([0.0, 0.0]) == 1.0 and stats.t_p_value([1, 1]) == 0.0
    # Holm over m = 4 (None not counted): sorted 0.01 <= 0.05/4, 0.012 <= 0.05/3, 0.03 > 0.05/2 stops: 0.04 not either
    assert stats.holm([0.04, 0.01, None, 0.012, 0.03]) == [False, True, None, True, False]
    assert stats.holm([0.04, 0.001]) == [True, True] and stats.holm([0.06, 0.001]) == [False, True]
    smd = repro["smd"]
    found = [{"compression": "50%", "selection": "snapkv", "a": "smd λ=0.1", "b": b, "metric": m, "p_value": p,
              "differences": [0.1, 0.2], "mean": 0.15, "half_width": 0.6, "resolved": False}
             for b, m, p in [("naive", "acc_after_dense", 0.03), ("sparse_rl", "acc_after_dense", 0.02),
                             ("naive", "acc_after", 0.06), ("sparse_rl", "acc_after", 0.001)]]  # fmt: skip
    smd.mark_multiplicity(found)
    # primary family {0.03, 0.02}: both rejected (0.02 <= 0.025, 0.03 <= 0.05); the other {0.06, 0.001}: 0.06 > 0.05
    assert [(f["primary"], f["holm"]) for f in found] == [(True, True), (True, True), (False, False), (False, True)]
    text = smd.comparisons_table(found)
    assert "| yes | 50% | snapkv | smd λ=0.1 − naive | dense | 2 | +0.150 ± 0.600 | no | 0.030 | yes |" in text
    assert "|  | 50% | snapkv | smd λ=0.1 − naive | compressed | 2 | +0.150 ± 0.600 | no | 0.060 | no |" in text


def test_smd_table_aggregates_seeds_with_t_intervals(repro):
    smd = repro["smd"]
    reward = [[step, 0.0 if step < 8 else 1.0] for step in range(10)]  # last 20%: steps 8, 9
    meta = {"mode": "naive", "lambda": None, "budget": 0.5, "selection": "recent"}
    scalars = [{"rollout/reward_mean": reward, "mismatch/logprob_abs_diff_max": [[0, 2.0], [1, 5.0]]},
               {"rollout/reward_mean": reward, "mismatch/logprob_abs_diff_max": [[0, 3.0]]},
               {"rollout/reward_mean": reward}]  # fmt: skip
    results = {}
    for seed, accuracy in enumerate([0.5, 0.6, 0.8]):
        result = _result(str(seed), {**meta, "seed": seed}, scalars[seed], accuracy)
        result["eval"]["mismatch_by_position"] = [0.0, 0.3 * (seed + 1)]
        result["eval_dense"] = {"accuracy": accuracy - 0.1}
        results[str(seed)] = result
    initial = {f"recent-b0.5-seed{s}": {"accuracy": a} for s, a in enumerate([0.25, 0.35, 0.45])}
    initial |= {f"dense-seed{s}": {"accuracy": a} for s, a in enumerate([0.3, 0.4, 0.5])}
    table, (row,) = smd.summarise(results, initial, steps=10)
    assert row["reward_last"] == [1.0, 1.0, 1.0]
    assert row["delta"] == pytest.approx([0.25, 0.25, 0.35])
    assert row["delta_dense"] == pytest.approx([0.1, 0.1, 0.2])  # dense-served after [0.4, 0.5, 0.7] - before
    assert row["mismatch_max"] == [5.0, 3.0, None]  # per seed; the table prints their maximum, 5.0 (not the mean 4)
    assert row["served_mismatch_by_position"] == pytest.approx([0.0, 0.6])
    # by hand, t_{0.975, 2} = 4.302653: after [0.5, 0.6, 0.8]: mean 0.6333, s 0.152753, half width 0.379459;
    # before [0.25, 0.35, 0.45]: s 0.1, half width 0.248414; delta [0.25, 0.25, 0.35]: mean 0.2833, s 0.057735,
    # half width 0.143422; greedy = after / 2: half width 0.189729; dense-served before [0.3, 0.4, 0.5]: 0.248414,
    # after [0.4, 0.5, 0.7]: 0.379459, delta [0.1, 0.1, 0.2]: mean 0.1333, half width 0.143422
    assert (
        "| 50% | recent | naive | - | 3 | 1.000 ± 0.000 | 0.350 ± 0.248 | 0.633 ± 0.379 | 0.283 ± 0.143 "
        "| 0.400 ± 0.248 | 0.533 ± 0.379 | 0.133 ± 0.143 | 0.317 ± 0.190 | - | - | - | - | 5.000 | 0.000 / 0.600 "
        "| - | - |"
    ) in table


def test_efficiency_table_pairs_every_run_with_the_dense_run_of_its_seed(repro):
    smd = repro["smd"]

    def scalars(generate: float, learner: float, kv: float, forward_rise: float, backward_rise: float) -> dict:
        return {"time/generate_s": [[0, generate], [1, 3 * generate]], "time/learner_s": [[0, learner], [1, learner]],
                "mem/kv_cache_mib": [[0, kv], [1, kv]], "mem/rollout_rise_mib": [[0, 4.0], [1, 4.0]],
                "mem/forward_rise_mib": [[0, forward_rise], [1, forward_rise]],
                "mem/backward_rise_mib": [[0, backward_rise], [1, 0.0]],
                "mem/rollout_peak_mib": [[0, 500.0], [1, 510.0]],
                "mem/backward_peak_mib": [[1, 520.0 + learner]]}  # fmt: skip

    smd_meta = {"mode": "smd", "lambda": 0.1, "budget": 0.5, "selection": "snapkv"}
    results = {
        "dense-seed0": _result("d0", {"mode": "dense", "seed": 0}, scalars(1.0, 2.0, 8.0, 3.0, 1.0), 0.5),
        "dense-seed1": _result("d1", {"mode": "dense", "seed": 1}, scalars(2.0, 4.0, 8.0, 3.0, 1.0), 0.5),
        "smd-seed0": _result("s0", {**smd_meta, "seed": 0}, scalars(1.5, 2.2, 4.0, 2.0, 5.0), 0.5),
        "smd-seed1": _result("s1", {**smd_meta, "seed": 1}, scalars(2.0, 4.8, 4.0, 2.0, 5.0), 0.5),
    }
    table, rows = smd.efficiency_table(results)
    dense, row = rows
    assert dense["rollout s/step / dense"] == [1.0, 1.0]
    assert row["rollout s/step"] == [3.0, 4.0]  # the mean over steps: (1.5 + 4.5) / 2, (2 + 6) / 2
    assert row["rollout s/step / dense"] == pytest.approx([1.5, 1.0])  # each seed against its own dense run
    assert row["learner s/step / dense"] == pytest.approx([1.1, 1.2])
    assert row["KV cache MiB / dense"] == [0.5, 0.5]
    # learner rise per step = max(forward, backward) = [5, 2] -> 3.5 against dense [3, 3] -> 3
    assert row["learner rise MiB"] == [3.5, 3.5] and row["learner rise MiB / dense"] == pytest.approx([3.5 / 3] * 2)
    assert row["peak MiB"] == [522.2, 524.8] and dense["peak MiB"] == [522.0, 524.0]
    # seed-paired ratios [1.5, 1.0]: mean 1.25, s 0.353553, t_{0.975, 1} = 12.706205: half width 3.18
    assert "| 50% | snapkv | smd | 0.1 | 2 | 3.500 | 1.25 ± 3.18 | 3.500 | 1.15 ± 0.64 | 4.000 | 0.50 ± 0.00 |" in table


def test_paired_differences_resolve_only_intervals_that_exclude_zero(repro):
    smd = repro["smd"]
    base = {"compression": "50%", "selection": "snapkv", "seeds": [0, 1, 2]}
    rows = [
        {**base, "mode": "smd", "lambda": 0.1, "acc_after": [0.6, 0.7, 0.8]},
        {**base, "mode": "naive", "lambda": None, "acc_after": [0.5, 0.55, 0.6]},
        {**base, "mode": "sparse_rl", "lambda": None, "acc_after": [0.7, 0.5, 0.4]},
    ]
    found = {(f["a"], f["b"]): f for f in smd.paired_differences(rows)}
    assert set(found) == {("smd λ=0.1", "naive"), ("smd λ=0.1", "sparse_rl"), ("naive", "sparse_rl")}
    lead = found[("smd λ=0.1", "naive")]  # differences 0.1, 0.15, 0.2: s 0.05, half width 4.302653 * 0.05 / sqrt 3
    assert lead["mean"] == pytest.approx(0.15) and lead["half_width"] == pytest.approx(0.124207, abs=1e-6)
    assert lead["resolved"]
    assert not found[("naive", "sparse_rl")]["resolved"]  # differences -0.2, 0.05, 0.2
    text = smd.comparisons_table(list(found.values()))
    # p of the paired t test: t = 0.15 / (0.05 / sqrt 3) = 5.196 at 2 dof, 1 - t / sqrt(2 + t^2) = 0.035; no Holm
    # verdict before `mark_multiplicity`
    assert "|  | 50% | snapkv | smd λ=0.1 − naive | compressed | 3 | +0.150 ± 0.124 | yes | 0.035 | - |" in text
    dense = {"compression": "0%", "selection": "-", "seeds": [0, 1, 2], "mode": "dense", "lambda": None,
             "acc_after": [0.6, 0.7, 0.8]}  # fmt: skip
    found = {(f["a"], f["b"]): f for f in smd.paired_differences([*rows, dense])}
    assert found[("smd λ=0.1", "dense")]["differences"] == [0.0, 0.0, 0.0]  # compared with the uncompressed run
    assert found[("naive", "dense")]["mean"] == pytest.approx(-0.15)


def test_distill_comparisons_pair_cells_by_seed(repro):
    distill = repro["distill"]
    metrics = dict.fromkeys(distill.COMPARED_METRICS, [0.0, 0.0, 0.0])
    rows = [
        {"cell": "teacher-forward", "seeds": [0, 1, 2], **metrics, "rl_dense_gain": [0.3, 0.2, None]},
        {"cell": "teacher-reverse", "seeds": [1, 2, 3], **metrics, "rl_dense_gain": [0.1, 0.1, 0.9]},
    ]
    text, found = distill.comparisons(rows)
    gain = next(f for f in found if f["metric"] == "Δ under dense GRPO")
    assert (gain["a"], gain["b"]) == ("teacher-forward", "teacher-reverse")
    assert gain["differences"] == [pytest.approx(0.1)]  # seed 1 only: seed 2 lacks a value, 0 and 3 a partner
    assert gain["half_width"] is None and not gain["resolved"]
    accuracy = next(f for f in found if f["metric"] == "acc after distillation")
    assert accuracy["differences"] == [0.0, 0.0] and not accuracy["resolved"]  # seeds 1 and 2: zero spread, no lead
    assert "| teacher-forward − teacher-reverse | Δ under dense GRPO | 1 | +0.100 | no |" in text


def test_distill_table_reports_both_rl_follow_ups_and_the_curriculum(repro):
    distill = repro["distill"]
    ladder = [[0, 8.0], [20, 8.0], [40, 16.0], [60, 16.0], [80, 32.0]]
    assert distill.curriculum_steps({"distill/max_new_tokens": ladder}) == (32.0, [40, 80])
    evaluation = {"accuracy": 0.5, "pass@1": 0.5, "pass@4": 0.7, "greedy_accuracy": 0.6, "entropy": 1.0, "length": 8,
                  "truncation_rate": 0.25}  # fmt: skip
    results = {
        "distill-mix-0.8-0.2+curriculum-seed0": {
            "cell": {"meta": {}}, "eval": evaluation, "eval_compressed": {**evaluation, "accuracy": 0.4},
            "scalars": {"distill/max_new_tokens": ladder},
        },
        "rl-dense-mix-0.8-0.2+curriculum-seed0": {"eval": {"accuracy": 0.75}},
        "rl-smd-mix-0.8-0.2+curriculum-seed0": {"eval": {"accuracy": 0.55}},
    }  # fmt: skip
    table, rows = distill.summarise(results, [0], ["mix-0.8-0.2+curriculum"])
    (row,) = rows
    assert row["rl_dense_gain"] == pytest.approx([0.25]) and row["rl_smd_gain"] == pytest.approx([0.15])
    assert "| 8.00 | 0.250 | 32 (40, 80) |" in table and "| 0.750 | 0.250 | 0.550 | 0.150 |" in table


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


def test_chain_evaluation_matches_an_independent_decode_and_measures_mismatch_by_position(repro, tmp_path):
    evaluate = repro["evaluate"]
    path = save_tiny_checkpoint(tmp_path / "policy", seed=3, initializer_range=0.35)
    model, tokenizer = load_causal_lm(str(path), dtype=torch.float32), load_tokenizer(str(path))
    settings = evaluate.EvalSettings(num_prompts=3, num_samples=2, batch_size=2, task="chain", max_new_tokens=6,
                                     num_hops=6, num_nodes=10)  # fmt: skip
    prompts, answers = evaluate.heldout_prompts(settings)
    assert [len(a) for a in answers] == [6, 6, 6]
    reference = load_causal_lm(str(path), dtype=torch.float32, attn_implementation="eager")
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    expected = chain_hops_reward(prompts, texts, answers)
    compressor = RecentWindow(12, sinks=1)
    result = evaluate.evaluate_policy(model, tokenizer, settings, compressor=compressor)
    assert result["greedy_accuracy"] == pytest.approx(sum(expected) / len(expected))
    positions = result["mismatch_by_position"]
    assert len(positions) == 6 and result["visible_fraction"] < 1
    assert positions[0] < 1e-5  # the first token is sampled right after the dense prefill
    assert max(positions) > 1e-3  # later ones from the evicted cache, scored densely
    dense = evaluate.evaluate_policy(model, tokenizer, settings)
    assert "mismatch_by_position" not in dense and dense["visible_fraction"] == 1.0


def test_walk_evaluation_scores_whole_answers_lengths_and_the_sparse_rl_veto(repro, tmp_path):
    """The free-length task: greedy whole-answer accuracy against transformers' own decode that stops at EOS, the
    length distribution, and the veto counts against the rule recomputed from the samples' log-probs."""
    evaluate = repro["evaluate"]
    path = save_tiny_checkpoint(tmp_path / "policy", seed=4, initializer_range=0.35)
    model, tokenizer = load_causal_lm(str(path), dtype=torch.float32), load_tokenizer(str(path))
    settings = evaluate.EvalSettings(num_prompts=4, num_samples=2, batch_size=4, task="walk", max_new_tokens=6,
                                     num_hops=4, min_hops=2, num_nodes=6)  # fmt: skip
    prompts, answers = evaluate.heldout_prompts(settings)
    assert all(2 <= len(a) <= 4 for a in answers)
    reference = load_causal_lm(str(path), dtype=torch.float32, attn_implementation="eager")
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    expected = chain_walk_reward(prompts, texts, answers)
    result = evaluate.evaluate_policy(model, tokenizer, settings, compressor=RecentWindow(8, sinks=1))
    assert result["greedy_accuracy"] == pytest.approx(sum(expected) / len(expected))
    counts = {int(k): v for k, v in result["length_counts"].items()}
    assert sum(counts.values()) == 8 and all(1 <= k <= 6 for k in counts)
    assert result["length"] == pytest.approx(sum(k * v for k, v in counts.items()) / 8)
    veto = {int(k): v for k, v in result["veto_by_length"].items()}
    assert {k: v[1] for k, v in veto.items()} == counts and all(0 <= v[0] <= v[1] for v in veto.values())
    generator = torch.Generator().manual_seed(0)  # the veto rule against the loss's own, row by row
    mu = torch.randn(64, 5, generator=generator) - 1
    dense = mu + 12 * torch.randn(64, 5, generator=generator).clamp(max=0)  # log ratios down to ~ -30
    mask = torch.rand(64, 5, generator=generator) < 0.8
    vetoed = evaluate.sparse_rl_vetoed(dense, mu, mask)
    assert 0 < int(vetoed.sum()) < 64
    for row in range(64):
        one = sparse_rl_correction(dense[row : row + 1], mu[row : row + 1], mask[row : row + 1])
        assert bool(vetoed[row]) == (one.rejected_sequence_fraction.item() == 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["retrieval", "chain", "walk"])
def test_quick_reproduction_runs_the_smallest_cell_end_to_end(repro, tmp_path, task):
    """``smd_table.py --quick``: the warm-up(s), the before-RL evaluation and one SMD cell in subprocesses, then the
    table, the comparisons and the JSON; a second invocation reruns nothing (minutes on 2 loaded cores)."""
    smd = repro["smd"]
    argv = ["--quick", "--task", task, "--modes", "smd", "--out", str(tmp_path), "--jobs", "1"]
    summary = smd.main(argv)
    (row,) = summary["rows"]
    assert (row["mode"], row["lambda"], row["seeds"], row["compression"]) == ("smd", 0.1, [0], "50%")
    cell = json.loads((tmp_path / "cells" / "smd-lam0.1-snapkv-b0.5-seed0.json").read_text())
    width = smd.TASKS[task]["eval"]["max_new_tokens"] if task != "retrieval" else 2
    assert cell["global_step"] == 2 and {"eval", "eval_dense"} <= cell.keys()
    positions = len(cell["eval"]["mismatch_by_position"])
    assert (positions == width if task != "walk" else 1 <= positions <= width)  # walks stop at their own EOS
    assert "mismatch_by_position" not in cell["eval_dense"]
    assert cell["eval"]["visible_fraction"] < 1 == cell["eval_dense"]["visible_fraction"]
    assert len(row["served_mismatch_by_position"]) == positions
    for name in ("calibration.md", "smd_table.md", "smd_comparisons.md", "smd_table.json",
                 "smd_mismatch_positions_b0.5.png"):  # fmt: skip
        assert (tmp_path / name).is_file(), name
    stamp = (tmp_path / "cells" / "smd-lam0.1-snapkv-b0.5-seed0.json").stat().st_mtime_ns
    assert smd.main(argv)["rows"] == summary["rows"]  # resumed: nothing rerun
    assert (tmp_path / "cells" / "smd-lam0.1-snapkv-b0.5-seed0.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_chain_calibration_quick_runs_warmups_and_step0_evaluations(tmp_path):
    """``chain_calibration.py --quick``: the shared retrieval warm-up, one chain warm-up, its dense and SnapKV
    evaluations at 50% and 70% compression, and the table and JSON written atomically; a rerun trains nothing."""
    sys.path.insert(0, str(REPRO))
    try:
        import chain_calibration
        import smd_table

        argv = ["--quick", "--out", str(tmp_path)]
        summary = chain_calibration.main(argv)
        (row,) = summary["rows"]
        assert (row["nodes"], row["hops"], row["seeds"]) == (6, 3, [0])
        assert set(row["compressed"]) == {"snapkv-b0.5", "snapkv-b0.3"}
        assert all(0.0 <= v <= 1.0 for v in [*row["dense"], *row["untrained"], *row["compressed"]["snapkv-b0.3"]])
        assert row["first_hop_floor"] == pytest.approx(1 / 3)
        assert row["independent_eviction"]["b0.5"] == pytest.approx((1 - 0.5**3) / (3 * 0.5))
        assert (tmp_path / "calibration.md").is_file() and json.loads((tmp_path / "calibration.json").read_text())
        policy = tmp_path / "n6-h3-w2" / "policies" / "warmup-seed0"
        stamp = policy.stat().st_mtime_ns
        assert chain_calibration.main(argv)["rows"] == summary["rows"]  # resumed: nothing retrained or re-evaluated
        assert policy.stat().st_mtime_ns == stamp
    finally:
        sys.path.remove(str(REPRO))
        smd_table.configure("retrieval")
