"""Lightning callbacks: the entropy-gated length curriculum, peak memory per training phase, generation evaluation,
stopping on SIGTERM / SIGINT at a safe point, progress as plain lines when the output is not a terminal."""

from lit_smd.callbacks.entropy_curriculum import EntropyCurriculum, LengthCurriculumTarget, ProbeStats
from lit_smd.callbacks.generation_eval import GenerationEval, MetricName
from lit_smd.callbacks.memory_profiler import MemoryProfiler
from lit_smd.callbacks.progress_lines import ProgressLines
from lit_smd.callbacks.stop_on_signal import StopOnSignal, StopRequested

__all__ = [
    "EntropyCurriculum",
    "GenerationEval",
    "LengthCurriculumTarget",
    "MemoryProfiler",
    "MetricName",
    "ProbeStats",
    "ProgressLines",
    "StopOnSignal",
    "StopRequested",
]
