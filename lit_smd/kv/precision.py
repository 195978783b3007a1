"""Float64 models stay float64: RMSNorm without the float32 round trip of transformers' Llama-style norms.

transformers' Llama-style ``RMSNorm`` (Llama, Qwen2/3, Mistral, ...; the T5 formula ``w * x / rms(x)``) casts its
input to float32, normalises, and casts back. In a float32 or bfloat16 model that is the intended upcast; in a
float64 model it *rounds every hidden state to float32* twice per layer. The rollout (a decode step over the cache
slots) and the learner (one masked SDPA pass) compute the same float64 activations up to float64 rounding
(~1e-16 relative), and a float64 value that lies within that distance of a float32 rounding boundary rounds to
different float32 neighbours in the two passes: one float32 ulp (6e-8 relative) jumps into the activations and
a single token's replay gap grows to ~1e-6 instead of ~1e-15. This is rare (about one element in 1e6 per norm
call), so it shows up on real models with long prompts and many layers, not reliably on tiny ones.

`keep_float64_norms` gives those modules a forward that computes in float64 when its input is float64 and
otherwise runs the module's own forward unchanged, so float32/bfloat16 models are not affected. Rotary
embeddings are not touched: transformers computes their angles and cos/sin in float32 from the integer
positions alone, elementwise, so a decode step and a teacher-forced pass get bitwise the same values.
"""

from __future__ import annotations

import torch

from lit_smd._forwards import own_forward

__all__ = ["keep_float64_norms"]


def _rms_norm_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != torch.float64:
        return type(module).forward(module, hidden_states)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return module.weight * (hidden_states * torch.rsqrt(variance + module.variance_epsilon))


def _is_t5_style_rms_norm(module: torch.nn.Module) -> bool:
    """transformers' Llama-style RMSNorm: the class name, a ``weight`` and a ``variance_epsilon`` (Gemma's differ)."""
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def keep_float64_norms(model: torch.nn.Module) -> int:
    """Let the Llama-style RMSNorm modules of ``model`` compute float64 inputs in float64 (idempotent).

    Args:
        model: Any module; its submodules are patched in place (an instance ``forward`` that survives
            ``copy.deepcopy`` and pickling).

    Returns:
        The number of norm modules that use the float64-preserving forward.
    """
    count = 0
    for module in model.modules():
        if not _is_t5_style_rms_norm(module):
            continue
        count += own_forward(module, _rms_norm_forward)  # not over someone else's (e.g. accelerate's hooks)
    return count
