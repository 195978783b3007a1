"""SMD's distillation term of `lit_smd.modules.GRPOModule`: a token KL between the dense and the shadow-masked views.

Shadow Mask Distillation (Zhu et al., arXiv 2605.06850) trains the masked view ``pi_theta(. | x, M)`` that sampled the
rollout, and keeps it close to the dense view ``pi_theta(. | x)`` of the same weights with a full-vocabulary token KL
(`lit_smd.losses.kl.chunked_token_kl`, computed in chunks so the ``[tokens, vocab]`` logits of both passes are never
all alive at once; both sides go through the policy's one `lit_smd.losses.head.OutputHead`).

``kl_stop_gradient="dense"`` (the project's objective): ``KL(sg[dense] || masked)``, the dense pass under ``no_grad``
as the teacher and the masked pass as the student. The teacher reuses the masked pass's prompt keys and values (the
prompt's hidden states are the same in both views) and runs only the completions
(`lit_smd.learner.dense_hidden_states`); in the training step the KL's chunked pass over the vocabulary also pushes
the policy loss's gradient through the lm_head (`smd_loss_and_kl`, `lit_smd.losses.logprobs.kl_with_policy_grad`).
``"masked"`` (the SMD README's variant): ``KL(dense || sg[masked])``, the reverse direction with the dense pass as the
student, so the gradient flows into a second, dense pass. The SMD repository's code uses neither (a sampled-token
hinge against rollout log-probs); it is not reproduced.
"""

from typing import Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel

from lit_smd.datamodules.experience import report_phase
from lit_smd.fsdp import is_sharded
from lit_smd.kv.flex import Backend
from lit_smd.learner import LearnerLayout, LearnerPass, dense_hidden_states, learner_hidden_states, shareable_groups
from lit_smd.losses.head import at_rows, head_rows, output_head, rows_of
from lit_smd.losses.kl import KLOutput, chunked_token_kl
from lit_smd.losses.logprobs import kl_with_policy_grad
from lit_smd.rollout import Rollout


def grpo_pass(
    model: PreTrainedModel, rollout: Rollout, layout: LearnerLayout, *, shadow: bool, keep_prompt_kv: bool = False,
    backend: Backend = "auto",
) -> LearnerPass:
    """One teacher-forced pass of ``model`` over ``rollout`` in ``layout``, as GRPO runs it.

    Under FSDP2 every rank must run the decoder (and its per-layer all-gathers) the same number of times, and which
    rows can share a prompt in the shadow view depends on each rank's own shadow masks. So the shadow view keeps the
    shared-prefix layout only when every row of every rank can share (one all-reduce of a flag; the usual case:
    prefill evictions qualify), and otherwise runs per row on all ranks.
    """
    if shadow and layout == "shared_prefix" and is_sharded(model) and not _all_ranks_shareable(rollout):
        layout = "per_row"
    return learner_hidden_states(
        model, rollout, shadow=shadow, layout=layout, keep_prompt_kv=keep_prompt_kv, backend=backend
    )


def _all_ranks_shareable(rollout: Rollout) -> bool:
    """Whether every row of every rank's ``rollout`` can share its prompt's encoding in the shadow view."""
    shareable, _ = shareable_groups(rollout, shadow=True)
    flag = torch.tensor([int(bool(shareable.all()) and len(rollout) > 0)], device=rollout.prompt_ids.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def smd_kl(
    policy: PreTrainedModel,
    rollout: Rollout,
    mask: Tensor,
    *,
    layout: LearnerLayout,
    stop_gradient: Literal["dense", "masked"],
    temperature: float,
    chunk_size: int,
    masked: LearnerPass | None = None,
    phase_owner: object = None,
    backend: Backend = "auto",
) -> KLOutput:
    """SMD's distillation term between the dense and the shadow-masked views of ``policy``.

    Args:
        policy: The policy (one set of weights, both views).
        rollout: A compressed rollout (with a shadow mask).
        mask: ``[B, N]`` bool, the tokens averaged over.
        layout: The learner layout of the passes (see `grpo_pass`).
        stop_gradient: ``"dense"``: ``KL(sg[dense] || masked)``; ``"masked"``: ``KL(dense || sg[masked])``.
        temperature: Sampling temperature the logits are divided by.
        chunk_size: Tokens per chunk of the KL's vocabulary projection.
        masked: The masked pass if already run (with ``keep_prompt_kv=True`` for the dense teacher to reuse its
            prompt).
        phase_owner: Whose ``phase_listeners`` hear the dense teacher pass as the ``"teacher"`` phase
            (`lit_smd.datamodules.experience.report_phase`); the module.
        backend: The passes' attention kernel (`lit_smd.kv.flex.Backend`).

    Returns:
        ``KLOutput``; its ``loss`` is the token-mean KL, ``forward_kl`` (dense) / ``reverse_kl`` (masked) its value.
    """
    head = output_head(policy)
    if masked is None:
        masked = grpo_pass(
            policy, rollout, layout, shadow=True, keep_prompt_kv=stop_gradient == "dense", backend=backend
        )
    masked_hidden = masked.hidden  # [B, N, H]
    common = {"temperature": temperature, "mask": mask, "chunk_size": chunk_size}
    if stop_gradient == "dense":
        with torch.no_grad(), report_phase(phase_owner, "teacher"):
            dense_hidden = dense_hidden_states(policy, rollout, masked)  # [B, N, H]
        return chunked_token_kl(masked_hidden, head, dense_hidden, teacher_head=head, **common)
    dense_hidden = grpo_pass(policy, rollout, layout, shadow=False, backend=backend).hidden  # [B, N, H]
    reverse = {"forward_weight": 0.0, "reverse_weight": 1.0}
    return chunked_token_kl(dense_hidden, head, masked_hidden.detach(), teacher_head=head, **reverse, **common)


def smd_loss_and_kl(
    policy: PreTrainedModel,
    rollout: Rollout,
    masked: LearnerPass,
    mask: Tensor,
    policy_loss: Tensor,
    logprobs: Tensor,
    *,
    kl_coef: float,
    temperature: float,
    chunk_size: int,
    phase_owner: object = None,
) -> tuple[Tensor, KLOutput, Tensor]:
    """The step's loss ``policy_loss + kl_coef * KL(sg[dense] || masked)``, in value and gradient, with the policy
    term's gradient pushed through the lm_head in the KL's pass (`lit_smd.losses.logprobs.kl_with_policy_grad`), and
    the masked view's entropy per token from that pass.

    ``logprobs`` are the masked pass's log-probs taken without gradient (``token_logprobs`` on ``masked.hidden``
    under ``no_grad``: no entropy, which the KL's pass computes anyway), made a leaf that requires grad before
    ``policy_loss`` was computed from them: five vocabulary projections per chunk in all, against six when the
    log-probs carry the gradient (`lit_smd.losses.logprobs.token_logprobs_and_kl`). Only the positions of the
    completion mask, of ``mask`` and where the policy term has a gradient reach the vocabulary projection.

    Args:
        policy: The policy.
        rollout: A compressed rollout (with a shadow mask).
        masked: The shadow-view pass with gradient (``keep_prompt_kv=True`` for the dense teacher to reuse its prompt).
        mask: ``[B, N]`` bool, the tokens the KL averages over.
        policy_loss: Scalar policy loss computed from ``logprobs``.
        logprobs: ``[B, N]`` the leaf ``policy_loss`` was computed from.
        kl_coef: The KL's weight.
        temperature: Sampling temperature the logits are divided by.
        chunk_size: Tokens per chunk of the vocabulary projection.
        phase_owner: Whose ``phase_listeners`` hear the dense teacher pass as the ``"teacher"`` phase.

    Returns:
        ``(loss, kl, entropy)``: the scalar loss to back-propagate, the KL's detached `KLOutput` (``forward_kl`` its
        value) and the ``[B, N]`` entropy of the masked view's temperature-scaled distribution (detached; what
        ``token_logprobs_and_entropy`` gives; 0 at the positions not projected).
    """
    if policy_loss.requires_grad:
        (logprob_grad,) = torch.autograd.grad(policy_loss, logprobs)  # [B, N]
    else:
        logprob_grad = torch.zeros_like(logprobs)  # [B, N]
    head = output_head(policy)
    with torch.no_grad(), report_phase(phase_owner, "teacher"):
        dense_hidden = dense_hidden_states(policy, rollout, masked)  # [B, N, H]
    rows = head_rows(rollout.completion_mask | mask | (logprob_grad != 0))  # [B, N]: the padding is not projected
    hidden = rows_of(masked.hidden, rows)  # [1, M, H]
    entropy = logprobs.new_empty(hidden.shape[:2])  # [1, M]
    head_loss, kl = kl_with_policy_grad(
        hidden, head, rows_of(rollout.completion_ids, rows), rows_of(logprob_grad, rows), rows_of(dense_hidden, rows),
        head, kl_coef=kl_coef, temperature=temperature, mask=rows_of(mask, rows), chunk_size=chunk_size,
        entropy_out=entropy,
    )  # fmt: skip
    return policy_loss.detach() + head_loss, kl, at_rows(entropy, rows, mask.shape)
