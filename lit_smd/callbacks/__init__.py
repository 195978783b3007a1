"""Lightning callbacks: the entropy-gated length curriculum."""

from lit_smd.callbacks.entropy_curriculum import EntropyCurriculum, LengthCurriculumTarget, ProbeStats

__all__ = ["EntropyCurriculum", "LengthCurriculumTarget", "ProbeStats"]
