"""SMD's distillation term of `lit_smd.modules.GRPOModule`: a token KL between the dense and the shadow-masked views.

Shadow Mask Distillation (Zhu et al., arXiv 2605.06850) trains the masked view ``pi_theta(. | x, M)`` that sampled the
rollout, and keeps it close to the dense view ``pi_theta(. | x)`` of the same weights with a full-vocabulary token KL
(`lit_smd.losses.kl.chunked_token_kl`, computed in chunks so the ``[tokens, vocab]`` logits of both passes are never
all alive at once; both sides go through the policy's one `lit_smd.losses.head.OutputHead`).

``kl_stop_gradient="dense"`` (the project's objective): ``KL(sg[dense] || masked)``, the dense pass under ``no_grad``
as the teacher and the masked pass as the student. With the shared-prefix layout the teacher reuses the masked pass's
prompt keys and values (the prompt's hidden states are the same in both views) and runs only the completions
(`lit_smd.learner.dense_hidden_states`). ``"masked"`` (the SMD README's variant): ``KL(dense || sg[masked])``, the
reverse direction with the dense pass as the student, so the gradient flows into a second, dense pass. The SMD
repository's code uses neither (a sampled-token hinge against rollout log-probs); it is not reproduced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lit_smd.datamodules.experience import report_phase
from lit_smd.learner import LearnerPass, dense_hidden_states
from lit_smd.losses.head import output_head
from lit_smd.losses.kl import KLOutput, chunked_token_kl
from lit_smd.rollout import Rollout

if TYPE_CHECKING:
    from lit_smd.modules.grpo import GRPOModule


def smd_kl(module: GRPOModule, rollout: Rollout, mask: Tensor, masked: LearnerPass | None = None) -> KLOutput:
    """SMD's distillation term between the dense and the shadow-masked views of ``module``'s policy.

    The dense teacher pass runs as the module's ``"teacher"`` phase (`lit_smd.datamodules.experience.report_phase`).

    Args:
        module: The learner (its ``policy``, ``kl_stop_gradient``, ``temperature``, ``logits_chunk_size`` and passes).
        rollout: A compressed rollout (with a shadow mask).
        mask: ``[B, N]`` bool, the tokens averaged over.
        masked: The masked pass if already run (with ``keep_prompt_kv=True`` for the teacher to reuse its prompt).

    Returns:
        ``KLOutput``; its ``loss`` is the token-mean KL, ``forward_kl`` (dense) / ``reverse_kl`` (masked) its value.
    """
    policy = module.policy
    head = output_head(policy)
    if masked is None:
        masked = module._pass(policy, rollout, shadow=True, keep_prompt_kv=module.kl_stop_gradient == "dense")
    masked_hidden = masked.hidden  # [B, N, H]
    common = {"temperature": module.temperature, "mask": mask, "chunk_size": module.logits_chunk_size}
    if module.kl_stop_gradient == "dense":
        with torch.no_grad(), report_phase(module, "teacher"):
            dense_hidden = dense_hidden_states(policy, rollout, masked)  # [B, N, H]
        return chunked_token_kl(masked_hidden, head, dense_hidden, teacher_head=head, **common)
    dense_hidden = module._pass(policy, rollout, shadow=False).hidden  # [B, N, H]
    reverse = {"forward_weight": 0.0, "reverse_weight": 1.0}
    return chunked_token_kl(dense_hidden, head, masked_hidden.detach(), teacher_head=head, **reverse, **common)
