"""GRPOModule: every mode trains, the reference stays frozen, SMD replays the rollout exactly, its KL term is exact."""

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from lit_smd.datamodules import ScoredRollout
from lit_smd.datamodules.experience import Experience
from lit_smd.datamodules.rollout import RolloutDataModule
from lit_smd.kv import RecentWindow, SnapKV
from lit_smd.learner import learner_hidden_states, score
from lit_smd.losses.grpo import policy_loss
from lit_smd.losses.head import OutputHead, output_head
from lit_smd.losses.logprobs import token_logprobs_and_entropy
from lit_smd.losses.rollout_correction import RolloutCorrection
from lit_smd.losses.sparse_rl import sparse_rl_correction
from lit_smd.modules.grpo import GRPOModule
from lit_smd.rollout import Rollout, generate
from lit_smd.tasks import key_value_retrieval
from lit_smd.tiny import build_tiny_model, save_tiny_checkpoint

MODES = ("dense", "naive", "sparse_rl", "smd")


def digit_share(prompts, completions, **kwargs):
    """A dense reward (share of digits), so groups have non-zero variance on a random model."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)


def make_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


def compressor_for(mode: str):
    return None if mode == "dense" else RecentWindow(12, sinks=2)


def sample(model, tokenizer, compressor, *, num_prompts=2, group=4, max_new_tokens=6, seed=0) -> Rollout:
    prompts = list(key_value_retrieval(num_prompts, num_pairs=3, seed=seed)["prompt"])
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    return generate(
        model,
        encoded["input_ids"],
        encoded["attention_mask"],
        compressor=compressor,
        max_new_tokens=max_new_tokens,
        num_generations=group,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
    )


def loader(*experiences: Experience) -> DataLoader:
    """Experiences from any source as a dataloader (``batch_size=None``: each item is already a batch)."""
    return DataLoader(list(experiences), batch_size=None)


def parameters_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(before, model) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_trains_and_keeps_the_reference_frozen(mode, tiny_model_factory, tokenizer, tmp_path):
    policy = tiny_model_factory(initializer_range=0.35)
    module = GRPOModule(policy, mode=mode, compressor=compressor_for(mode), beta=0.05, optimizer=adamw)
    data = RolloutDataModule(
        key_value_retrieval(8, num_pairs=3),
        tokenizer,
        [digit_share],
        prompts_per_step=2,
        num_generations=4,
        max_new_tokens=6,
        use_chat_template=False,
    )
    before = parameters_of(policy)
    trainer = make_trainer(logger=TensorBoardLogger(tmp_path, name="grpo", default_hp_metric=False))
    trainer.fit(module, data)

    assert not same(before, policy), "the policy did not change"
    assert module.reference is not None and same(before, module.reference), "the reference moved"
    assert not any(p.requires_grad for p in module.reference.parameters())
    logged = trainer.callback_metrics
    expected = {
        "train/loss",
        "train/policy_loss",
        "train/kl_ref",
        "train/entropy",
        "train/clip_fraction",
        "train/clip_low_fraction",
        "train/clip_high_fraction",
        "mismatch/logprob_abs_diff_mean",
        "mismatch/logprob_abs_diff_max",
        "mismatch/k3_kl",
        "rollout/reward_mean",
        "rollout/reward_std",
        "rollout/reward/digit_share",
        "rollout/advantage_mean",
        "rollout/advantage_std",
        "rollout/advantage_abs_max",
        "rollout/zero_std_group_fraction",
        "rollout/completion_length_mean",
        "rollout/completion_length_max",
        "rollout/truncated_fraction",
        "time/rollout_s",
        "time/learner_s",
        "train/flex_compiles",
    }
    expected |= {"kv/visible_fraction"} if mode != "dense" else set()
    expected |= {"smd/kl"} if mode == "smd" else set()
    expected |= (
        {"sparse_rl/rejected_sequence_fraction", "sparse_rl/masked_token_fraction", "sparse_rl/weight_mean"}
        if mode == "sparse_rl"
        else set()
    )
    assert expected <= set(logged), sorted(expected - set(logged))
    assert all(torch.isfinite(torch.as_tensor(v)) for v in logged.values())
    assert list((tmp_path / "grpo").rglob("events.out.tfevents.*")), "no TensorBoard event file"


def test_smd_replays_the_rollout_and_naive_divides_by_the_dense_policy_not_mu(peaky_model_factory, tokenizer):
    """Same compressed rollouts, one pass: SMD's ratio is 1 and its mismatch ~0; the naive learner's view is far from
    the sampler's but its ratio is exactly 1 (denominator = the dense policy before the update, as TRL / verl)."""
    policy = peaky_model_factory()
    rollout = sample(policy, tokenizer, RecentWindow(10, sinks=2), max_new_tokens=8)
    rewards = torch.arange(len(rollout), dtype=torch.float64)
    metrics, old = {}, {}
    for mode in ("smd", "naive"):
        module = GRPOModule(copy.deepcopy(policy), mode=mode, compressor=RecentWindow(10, sinks=2), optimizer=adamw)
        experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=4))
        old[mode] = experience.old_logprobs
        trainer = make_trainer(max_steps=1)
        trainer.fit(module, train_dataloaders=loader(experience))
        metrics[mode] = {k: float(v) for k, v in trainer.callback_metrics.items()}

    smd, naive = metrics["smd"], metrics["naive"]
    assert abs(smd["train/ratio_min"] - 1) < 1e-10 and abs(smd["train/ratio_max"] - 1) < 1e-10
    assert smd["mismatch/logprob_abs_diff_max"] < 1e-10
    assert abs(smd["mismatch/k3_kl"]) < 1e-12
    assert naive["mismatch/logprob_abs_diff_mean"] > 0.1  # the dense learner does not see what the sampler saw
    assert naive["mismatch/k3_kl"] > 0.01
    assert naive["train/ratio_min"] == pytest.approx(1, abs=1e-12)
    assert naive["train/ratio_max"] == pytest.approx(1, abs=1e-12)
    assert naive["train/clip_fraction"] == 0
    assert old["smd"] is None and old["naive"] is None  # on-policy: the gradient pass's own log-probs divide
    mask = rollout.completion_mask
    with torch.no_grad():
        dense = score(policy, rollout, shadow=False)  # independent dense recomputation, untrained copy
    for mode, expected in (("smd", rollout.logprobs), ("naive", dense)):  # two passes: pi_old recomputed up front
        module = GRPOModule(copy.deepcopy(policy), mode=mode, compressor=RecentWindow(10, sinks=2))
        recomputed = module.make_experience(
            ScoredRollout(rollout, rewards, num_generations=4, num_iterations=2)
        ).old_logprobs
        torch.testing.assert_close(recomputed[mask], expected[mask], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stop_gradient", ["dense", "masked"])
def test_smd_kl_matches_a_full_logits_reference(peaky_model_factory, tokenizer, stop_gradient):
    policy = peaky_model_factory()
    rollout = sample(policy, tokenizer, RecentWindow(10, sinks=2), num_prompts=1, group=3, max_new_tokens=5)
    module = GRPOModule(
        policy,
        mode="smd",
        compressor=RecentWindow(10, sinks=2),
        kl_stop_gradient=stop_gradient,
        temperature=0.7,
        logits_chunk_size=4,
        learner_layout="per_row",  # the reference below is per-row (layouts: tests/test_learner.py)
    )
    mask = rollout.completion_mask.clone()
    mask[0, -1] = False

    kl = module.smd_kl(rollout, mask)
    kl.loss.backward()
    chunked_grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()

    lm_head = policy.get_output_embeddings()
    masked = lm_head(learner_hidden_states(policy, rollout, shadow=True, layout="per_row").hidden) / 0.7  # [B, N, V]
    dense = lm_head(learner_hidden_states(policy, rollout, shadow=False, layout="per_row").hidden) / 0.7  # [B, N, V]
    if stop_gradient == "dense":  # KL(sg[dense] || masked)
        teacher, student = dense.detach().log_softmax(-1), masked.log_softmax(-1)
    else:  # KL(dense || sg[masked])
        teacher, student = masked.detach().log_softmax(-1), dense.log_softmax(-1)
    per_token = (
        (teacher.exp() * (teacher - student)).sum(-1)
        if stop_gradient == "dense"
        else (student.exp() * (student - teacher)).sum(-1)
    )
    reference = per_token[mask].mean()
    reference.backward()

    value = kl.forward_kl if stop_gradient == "dense" else kl.reverse_kl
    torch.testing.assert_close(kl.loss.detach(), reference.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(value, reference.detach(), rtol=1e-10, atol=1e-12)
    for chunked, param in zip(chunked_grads, policy.parameters(), strict=True):
        torch.testing.assert_close(chunked, param.grad, rtol=1e-8, atol=1e-10)


def _step_one_by_one(module, rollout, experience, *, shadow: bool):
    """The step's loss (back-propagated) and entropy ``[B, N]`` from the learner pass, `token_logprobs_and_entropy`
    over the whole batch, `policy_loss` and (``kl_coef``) `GRPOModule.smd_kl`, run one by one (temperature 0.8,
    chunks of 5 rows)."""
    policy = module.policy
    hidden = learner_hidden_states(policy, rollout, shadow=shadow).hidden
    logprobs, entropy = token_logprobs_and_entropy(hidden, output_head(policy), rollout.completion_ids,
                                                   temperature=0.8, chunk_size=5)  # fmt: skip
    reference = policy_loss(
        logprobs, logprobs.detach(), experience.advantages, experience.loss_mask, epsilon=module.epsilon,
        epsilon_high=module.epsilon_high, loss_type=module.loss_type,
        max_completion_length=experience.max_completion_length, token_weights=experience.token_weights,
    ).loss  # fmt: skip
    if module.kl_coef:
        reference = reference + module.kl_coef * module.smd_kl(rollout, experience.loss_mask).loss
    reference.backward()
    return reference, entropy


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_smd_step_equals_the_policy_loss_plus_the_separately_computed_kl(peaky_model_factory, tokenizer, kl_coef):
    """The step's policy gradient carried by the KL's pass (`smd_loss_and_kl`) against `token_logprobs_and_entropy`,
    `policy_loss` and `GRPOModule.smd_kl` run one by one: loss, entropy metric and every parameter's gradient."""
    policy = peaky_model_factory()
    rollout = sample(policy, tokenizer, RecentWindow(10, sinks=2), max_new_tokens=7)
    module = GRPOModule(policy, mode="smd", compressor=RecentWindow(10, sinks=2), kl_coef=kl_coef, temperature=0.8,
                        logits_chunk_size=5, rollout_correction=RolloutCorrection("none"))  # fmt: skip
    rewards = torch.arange(len(rollout), dtype=torch.float64) % 3
    experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=4))
    experience.loss_mask[0, -2:] = False  # the KL averages over the loss mask, the entropy over the completion
    logged = {}
    module.log = lambda key, value, **kwargs: logged.__setitem__(key, value)
    loss = module.training_step(experience, 0)
    loss.backward()
    fused = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()

    reference, entropy = _step_one_by_one(module, rollout, experience, shadow=True)
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=1e-12, atol=1e-13)
    mask = rollout.completion_mask
    torch.testing.assert_close(logged["train/entropy"], entropy[mask].mean(), rtol=1e-12, atol=1e-13)
    for got, param in zip(fused, policy.parameters(), strict=True):
        torch.testing.assert_close(got, param.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["dense", "smd"])
def test_only_completion_tokens_reach_the_vocabulary_projection(peaky_model_factory, tokenizer, monkeypatch, mode):
    """Completions of different lengths: the step projects only the completion tokens to the vocabulary (the head's
    rows are the mask's), with the loss, the entropy metric and every gradient of projecting the whole batch."""
    import lit_smd.losses.logprobs as logprobs_module
    import lit_smd.modules._grpo_smd as smd_module

    policy = peaky_model_factory()
    compressor = compressor_for(mode)
    rollout = sample(policy, tokenizer, compressor, max_new_tokens=7)
    cut = torch.arange(7)[None, :] >= torch.tensor([7, 3, 5, 1, 7, 6, 2, 4])[:, None]  # rows that stopped early
    rollout.completion_mask = rollout.completion_mask & ~cut
    rollout.completion_ids = rollout.completion_ids.masked_fill(cut, 0)
    rollout.logprobs = rollout.logprobs.masked_fill(cut, 0.0)
    kl_coef = 0.3 if mode == "smd" else 0.0
    module = GRPOModule(policy, mode=mode, compressor=compressor, kl_coef=kl_coef, temperature=0.8,
                        logits_chunk_size=5, rollout_correction=RolloutCorrection("none"))  # fmt: skip
    rewards = torch.arange(len(rollout), dtype=torch.float64) % 3
    experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=4))
    experience.loss_mask[0, -2:] = False  # the KL averages over the loss mask, the entropy over the completion
    projected = []  # rows reaching the vocabulary projection per call

    def spy_on(owner, name):
        original = getattr(owner, name)

        def spy(hidden, *args, **kwargs):
            projected.append(hidden.shape[:-1])
            return original(hidden, *args, **kwargs)

        monkeypatch.setattr(owner, name, spy)

    spy_on(logprobs_module, "_apply")  # the chunked pass of token_logprobs(_and_entropy), after their mask
    spy_on(smd_module, "kl_with_policy_grad")
    logged = {}
    module.log = lambda key, value, **kwargs: logged.__setitem__(key, value)
    loss = module.training_step(experience, 0)
    loss.backward()
    mask = rollout.completion_mask
    assert len(projected) == 2 if mode == "smd" else len(projected) == 1
    assert all(shape.numel() == int(mask.sum()) for shape in projected) and int(mask.sum()) < mask.numel() - 8
    fused = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()

    reference, entropy = _step_one_by_one(module, rollout, experience, shadow=mode == "smd")
    torch.testing.assert_close(loss.detach(), reference.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(logged["train/entropy"], entropy[mask].mean(), rtol=1e-12, atol=1e-13)
    for got, param in zip(fused, policy.parameters(), strict=True):
        torch.testing.assert_close(got, param.grad, rtol=1e-9, atol=1e-12)
    with torch.no_grad():  # the module's forward and score: the learner's log-probs, exactly 0 at the padding
        expected = score(policy, rollout, shadow=mode == "smd", temperature=0.8)  # [B, N], per row
        for got in (module(rollout), module.score(policy, rollout, shadow=mode == "smd")):
            torch.testing.assert_close(got[mask], expected[mask], rtol=1e-12, atol=1e-13)
            assert bool((got[~mask] == 0).all())


def test_chunked_token_logprobs_match_full_log_softmax(peaky_model_factory):
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    logprobs, entropy = token_logprobs_and_entropy(hidden, OutputHead(weight), ids, temperature=0.5, chunk_size=3)
    full = (hidden @ weight.T / 0.5).log_softmax(-1)
    expected = full.gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach())
    grads = torch.autograd.grad(logprobs.sum(), (hidden, weight))
    expected_grads = torch.autograd.grad(expected.sum(), (hidden, weight))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_zero_variance_groups_get_zero_advantage(tiny_model_factory, tokenizer):
    policy = tiny_model_factory()
    rollout = sample(policy, tokenizer, RecentWindow(12, sinks=2))
    module = GRPOModule(policy, mode="smd", compressor=RecentWindow(12, sinks=2), optimizer=adamw)
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=4))
    assert torch.equal(experience.advantages[:4], torch.zeros(4))
    assert experience.advantages[4:].abs().min() > 0
    assert experience.metrics["rollout/zero_std_group_fraction"] == 0.5

    constant = module.make_experience(ScoredRollout(rollout, torch.full((8,), 0.3), num_generations=4))
    assert torch.equal(constant.advantages, torch.zeros(8))
    trainer = make_trainer(max_steps=1)
    trainer.fit(module, train_dataloaders=loader(constant))
    assert float(trainer.callback_metrics["train/policy_loss"]) == 0.0
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize("mode", ["sparse_rl", "smd"])
def test_trains_on_rollouts_loaded_from_disk(mode, tiny_model_factory, tokenizer, tmp_path):
    sampler = tiny_model_factory(initializer_range=0.35)
    sample(sampler, tokenizer, RecentWindow(12, sinks=2)).save(tmp_path / "rollout.pt")

    policy = tiny_model_factory(initializer_range=0.35)
    module = GRPOModule(policy, mode=mode, compressor=RecentWindow(12, sinks=2), optimizer=adamw)
    rollout = Rollout.load(tmp_path / "rollout.pt")
    experience = module.make_experience(
        ScoredRollout(rollout, torch.tensor([0.0, 1, 2, 3, 3, 2, 1, 0]), num_generations=4)
    )
    before = parameters_of(policy)
    make_trainer(max_steps=1).fit(module, train_dataloaders=loader(experience))
    assert not same(before, policy)


def test_sparse_rl_precomputes_the_correction_over_the_whole_batch(peaky_model_factory, tokenizer):
    policy = peaky_model_factory()
    rollout = sample(policy, tokenizer, RecentWindow(10, sinks=2), max_new_tokens=8)
    module = GRPOModule(policy, mode="sparse_rl", compressor=RecentWindow(10, sinks=2))
    experience = module.make_experience(
        ScoredRollout(rollout, torch.arange(8.0), num_generations=4, num_iterations=2, minibatch_size=4)
    )
    mask = rollout.completion_mask
    with torch.no_grad():
        dense = score(policy, rollout, shadow=False)  # independent dense recomputation
    torch.testing.assert_close(experience.old_logprobs[mask], dense[mask], rtol=1e-12, atol=1e-12)
    expected = sparse_rl_correction(dense, rollout.logprobs, mask, module.sparse_rl)  # over all 8 rows at once
    torch.testing.assert_close(experience.token_weights, expected.weights, rtol=1e-10, atol=1e-12)
    assert torch.equal(experience.loss_mask, expected.mask)
    on_policy = module.make_experience(ScoredRollout(rollout, torch.arange(8.0), num_generations=4))
    assert on_policy.old_logprobs is None  # the ratio divides by the gradient pass itself; xi still uses pi_old
    torch.testing.assert_close(on_policy.token_weights, expected.weights, rtol=1e-10, atol=1e-12)
    assert experience.token_weights is not None
    assert not torch.equal(experience.loss_mask, rollout.completion_mask)  # peaky model: some tokens rejected
    assert experience.metrics["sparse_rl/masked_token_fraction"] > 0


def test_mask_truncated_completions_with_every_completion_truncated(tiny_model_factory, tokenizer):
    policy = tiny_model_factory()
    rollout = sample(policy, tokenizer, RecentWindow(12, sinks=2), max_new_tokens=2)
    rollout.finish_reason = ["length"] * len(rollout)
    module = GRPOModule(policy, mode="smd", compressor=RecentWindow(12, sinks=2), mask_truncated_completions=True)
    with pytest.warns(UserWarning, match="no policy gradient"):
        experience = module.make_experience(ScoredRollout(rollout, torch.arange(8.0), num_generations=4))
    assert not experience.loss_mask.any()
    assert experience.metrics["rollout/truncated_fraction"] == 1.0
    trainer = make_trainer(max_steps=1)
    trainer.fit(module, train_dataloaders=loader(experience))
    assert float(trainer.callback_metrics["train/policy_loss"]) == 0.0


def test_empty_completions_do_not_break_the_step(tiny_model_factory, tokenizer):
    policy = tiny_model_factory()
    rollout = sample(policy, tokenizer, RecentWindow(12, sinks=2))
    rollout.completion_mask[0] = False  # a completion without tokens (e.g. from another pipeline)
    rollout.completion_mask[1, 1:] = False  # a one-token (EOS-only) completion
    rollout.logprobs = rollout.logprobs.masked_fill(~rollout.completion_mask, 0.0)
    module = GRPOModule(policy, mode="smd", compressor=RecentWindow(12, sinks=2), optimizer=adamw)
    experience = module.make_experience(ScoredRollout(rollout, torch.arange(8.0), num_generations=4))
    trainer = make_trainer(max_steps=1)
    trainer.fit(module, train_dataloaders=loader(experience))
    assert all(torch.isfinite(torch.as_tensor(v)) for v in trainer.callback_metrics.values())


def test_mode_and_rollout_checks(tiny_model_factory, tokenizer):
    policy = tiny_model_factory()
    with pytest.raises(ValueError, match="mode='dense'.*compressor"):
        GRPOModule(policy, mode="dense", compressor=SnapKV(0.5))
    with pytest.raises(ValueError, match="pass a compressor"):
        GRPOModule(policy, mode="smd")
    with pytest.raises(ValueError, match="kl_stop_gradient"):
        GRPOModule(policy, mode="smd", compressor=SnapKV(0.5), kl_stop_gradient="both")
    dense_rollout = sample(policy, tokenizer, None)
    smd = GRPOModule(policy, mode="smd", compressor=RecentWindow(12, sinks=2))
    with pytest.raises(ValueError, match="needs compressed rollouts"):
        smd.make_experience(ScoredRollout(dense_rollout, torch.zeros(8), num_generations=4))
    compressed = sample(policy, tokenizer, RecentWindow(12, sinks=2))
    with pytest.raises(ValueError, match="mode='naive'"):
        GRPOModule(policy, mode="dense").make_experience(ScoredRollout(compressed, torch.zeros(8), num_generations=4))
    with pytest.raises(ValueError, match="finite"):
        smd.make_experience(
            ScoredRollout(compressed, torch.tensor([0.0, 1, float("nan"), 0, 0, 0, 0, 0]), num_generations=4)
        )
    with pytest.raises(TypeError, match="Experience"):
        smd.training_step(compressed, 0)


def test_policy_and_reference_from_a_local_directory(tmp_path, tokenizer):
    path = str(save_tiny_checkpoint(tmp_path / "tiny", tokenizer=tokenizer))
    module = GRPOModule(path, mode="dense", beta=0.1, model_dtype="float32")
    assert module.policy is None and module.hparams.policy == path
    module.configure_model()
    module.configure_model()  # idempotent
    assert module.policy is not None and module.reference is not None and module.reference is not module.policy
    assert same(parameters_of(module.policy), module.reference)
    lazy = GRPOModule(path, mode="dense", beta=0.1)
    experience = lazy.make_experience(
        ScoredRollout(sample(module.policy, tokenizer, None), torch.arange(8.0), num_generations=4)
    )
    assert lazy.reference is not None and experience.ref_logprobs is not None  # loaded on first use


def test_constructible_from_yaml_by_lightning_cli(tmp_path, tokenizer, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["lit-smd"])

    path = str(save_tiny_checkpoint(tmp_path / "tiny", tokenizer=tokenizer))
    config = {
        "model": {
            "policy": path,
            "mode": "smd",
            "compressor": {"class_path": "lit_smd.kv.RecentWindow", "init_args": {"budget": 0.5, "sinks": 2}},
            "sparse_rl": {"lower": 0.4},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-5}},
        },
        "data": {
            "dataset": "key_value_retrieval",
            "dataset_kwargs": {"size": 8, "num_pairs": 3},
            "tokenizer": path,
            "reward_funcs": ["lit_smd.rewards.math_answer_reward"],
            "prompts_per_step": 2,
            "num_generations": 2,
        },
        "trainer": {"accelerator": "cpu", "logger": False, "enable_checkpointing": False},
        "seed_everything": 0,
    }
    cli = LightningCLI(GRPOModule, RolloutDataModule, run=False, args=config, save_config_callback=None)
    assert isinstance(cli.model.compressor, RecentWindow) and cli.model.compressor.sinks == 2
    assert cli.model.sparse_rl.lower == 0.4
    optimizer = cli.model.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 1e-5
    assert cli.datamodule.num_generations == 2
    assert isinstance(Experience, type)


def test_default_logits_chunk_follows_the_vocabulary_on_the_cpu(tiny_model):
    """``logits_chunk_size=None`` (the default): on the CPU as many rows as keep a float32 ``[rows, vocab]`` buffer
    within 32 MiB (a larger one is mapped and page-faulted anew per chunk); a given size is used as it is."""
    assert GRPOModule(tiny_model, mode="dense")._chunk_rows() == 1024  # a small vocabulary: the 1024-row cap
    wide = build_tiny_model("qwen3", vocab_size=49152)
    assert GRPOModule(wide, mode="dense")._chunk_rows() == 128  # 128 x 49152 x 4 B = 24 MiB
    assert GRPOModule(wide, mode="dense", logits_chunk_size=1024)._chunk_rows() == 1024
