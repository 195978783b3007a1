"""Entropy-gated length curriculum: grow the completion length only while the student's predictive entropy holds up.

Algorithm
    A ladder of maximum lengths ``L_0 < L_1 < ...`` (e.g. 128 -> 256 -> ... -> 4096). Training starts at ``L_0``. Every
    ``check_every_n_steps`` optimizer steps the student completes a held-out probe set at the current length and its
    mean per-token predictive entropy ``H`` is measured. After ``patience`` consecutive checks with
    ``H >= entropy_threshold`` the curriculum moves to the next length; a check below the threshold resets the count,
    so the curriculum holds the last stable length while the entropy is low (a collapsing, over-confident student is
    not asked to write longer). The last rung is kept to the end.

Paper
    Decoupling KL and trajectories, arXiv 2605.16826: "move from L_m to L_{m+1} only if the mean per-token entropy on a
    held-out set satisfies H_m >= H_min, otherwise stay at the last stable length". The threshold and the ladder are
    not disclosed there; ``patience`` and the check interval are this implementation's.

Interfaces (documented protocols, no private attributes)
    - The LightningModule (`LengthCurriculumTarget`, e.g. `lit_smd.modules.DistillModule`): ``max_new_tokens``,
      ``set_max_new_tokens(int)``, ``probe(PromptBatch) -> ProbeStats``.
    - The DataModule (`lit_smd.datamodules.ProbeSource`): ``probe_batch() -> PromptBatch``, the held-out prompts.

Logged keys
    ``distill/curriculum_stage`` and ``distill/curriculum_length`` (every step), and at each check
    ``distill/probe_entropy``, ``distill/probe_response_length``, ``distill/probe_truncated_fraction``.

Resuming
    The stage, the count of consecutive passing checks and the step of the last check are saved in checkpoints
    (``state_dict``); on ``fit(ckpt_path=...)`` the restored length is applied to the module before training starts,
    so a resumed run follows the schedule of an uninterrupted one exactly. Distributed: the probe entropy is averaged
    over ranks, so every rank takes the same decision.
"""

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["EntropyCurriculum", "LengthCurriculumTarget", "ProbeStats"]


class ProbeStats(NamedTuple):
    """One probe of the student on held-out prompts.

    Attributes:
        entropy: Mean per-token predictive entropy (nats) over the completion tokens.
        response_length: Mean completion length (tokens).
        truncated_fraction: Share of completions that hit the length limit.
    """

    entropy: float
    response_length: float
    truncated_fraction: float


@runtime_checkable
class LengthCurriculumTarget(Protocol):
    """What `EntropyCurriculum` asks of the LightningModule."""

    @property
    def max_new_tokens(self) -> int: ...

    def set_max_new_tokens(self, value: int) -> None: ...

    def probe(self, prompts: Any) -> ProbeStats: ...


class EntropyCurriculum(Callback):
    """Raise the module's ``max_new_tokens`` along ``lengths`` while the probe entropy stays above a threshold.

    Args:
        lengths: Strictly increasing maximum lengths; training starts at the first.
        entropy_threshold: ``H_min`` (nats): a check passes when the probe entropy is at least this.
        check_every_n_steps: Optimizer steps between checks.
        patience: Consecutive passing checks needed to move to the next length.
    """

    def __init__(
        self, lengths: list[int], entropy_threshold: float, check_every_n_steps: int = 100, patience: int = 1
    ) -> None:
        if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
            raise ValueError(f"lengths must be a non-empty list of integers >= 1, got {lengths!r}")
        if any(b <= a for a, b in zip(lengths, lengths[1:], strict=False)):
            raise ValueError(f"lengths must be strictly increasing, got {lengths}")
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be >= 1, got {check_every_n_steps}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.lengths = list(lengths)
        self.entropy_threshold = float(entropy_threshold)
        self.check_every_n_steps = check_every_n_steps
        self.patience = patience
        self.stage = 0
        self.passed_checks = 0
        self.last_check_step = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(lengths=self.lengths, entropy_threshold=self.entropy_threshold)

    @property
    def current_length(self) -> int:
        """The maximum length of the current stage."""
        return self.lengths[self.stage]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(pl_module, LengthCurriculumTarget):
            raise TypeError(
                f"EntropyCurriculum needs a module with `max_new_tokens`, `set_max_new_tokens` and `probe` "
                f"(lit_smd.callbacks.LengthCurriculumTarget); {type(pl_module).__name__} lacks them"
            )
        if not callable(getattr(trainer.datamodule, "probe_batch", None)):
            raise TypeError(
                "EntropyCurriculum needs a DataModule with `probe_batch()` (held-out prompts, e.g. "
                "DistillDataModule(num_probe_prompts=...)); "
                f"got {type(trainer.datamodule).__name__}"
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pl_module.set_max_new_tokens(self.current_length)  # after a restore: the saved stage's length

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > 0 and step % self.check_every_n_steps == 0 and step != self.last_check_step:
            self.last_check_step = step
            self._check(trainer, pl_module)
        pl_module.log("distill/curriculum_stage", float(self.stage), on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("distill/curriculum_length", float(self.current_length), on_step=True, on_epoch=False,
                      batch_size=1)

    def _check(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stats = pl_module.probe(trainer.datamodule.probe_batch())
        values = torch.tensor([stats.entropy, stats.response_length, stats.truncated_fraction], device=pl_module.device)
        entropy, length, truncated = trainer.strategy.reduce(values, reduce_op="mean").tolist()
        self.passed_checks = self.passed_checks + 1 if entropy >= self.entropy_threshold else 0
        if self.passed_checks >= self.patience and self.stage < len(self.lengths) - 1:
            self.stage += 1
            self.passed_checks = 0
            pl_module.set_max_new_tokens(self.current_length)
        for name, value in (("entropy", entropy), ("response_length", length), ("truncated_fraction", truncated)):
            pl_module.log(f"distill/probe_{name}", value, on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "passed_checks": self.passed_checks,
            "last_check_step": self.last_check_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A different ladder or threshold has another state_key: Lightning then restores nothing (a new schedule).
        self.stage = int(state_dict["stage"])
        self.passed_checks = int(state_dict["passed_checks"])
        self.last_check_step = int(state_dict["last_check_step"])
