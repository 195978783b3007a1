"""Building the offline teacher-logit cache (``lit-smd cache-teacher``): teacher trajectories and top-k log-probs.

Algorithm
    `build_teacher_cache` runs the teacher over a prompt set (`lit_smd.datamodules.DistillDataModule`, the same
    prompts an online run uses): it samples ``num_samples`` trajectories per prompt (`lit_smd.rollout.generate`, dense)
    and re-scores them teacher-forced (`teacher_topk_logprobs`, which `lit_smd.modules.DistillModule` also uses
    online), keeping at every completion position the ``top_k`` largest log-probs of the temperature-scaled
    full-vocabulary distribution, sorted descending. The format, the checks on loading and the DataModule that trains
    from the result are in `lit_smd.datamodules.teacher_cache`.

Safety
    A cache is built in temporary sibling folders (``.<name>.lit_smd-staging-*``, ``.<name>.lit_smd-building-*``),
    fsync'ed, and moved into place only when complete, so a failed build leaves nothing behind and never touches an
    existing cache. Replacing one needs ``overwrite=True``, and only an empty folder or a folder whose
    ``metadata.json`` parses as a lit_smd teacher cache and which holds nothing but the files it lists is replaced. The
    swap is one atomic ``renameat2(RENAME_EXCHANGE)`` on Linux, so ``output_dir`` always holds the old or the new
    cache; elsewhere it is two renames, and a build killed between them is repaired by the next build or load
    (`lit_smd.datamodules.teacher_cache.recover_interrupted_build`), which also removes the temporary folders of
    killed builds (only ours: names with the build's process id, of processes that are gone).

Departures
    - DistillKit's polynomial tail compression is not implemented: plain top-k only.
    - The build writes the Arrow data twice (a streamed staging file, then ``save_to_disk``): twice the cache size of
      free disk is needed while building.
"""

import importlib.metadata
import json
import logging
import math
import os
import shutil
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch
import transformers
from datasets import Dataset
from datasets.arrow_writer import ArrowWriter
from torch import Tensor
from transformers import PreTrainedModel

from lit_smd.atomic import atomic_write_text, exchange, fsync_dir, fsync_tree, staging_dir, temp_name
from lit_smd.datamodules.distill import DistillDataModule
from lit_smd.datamodules.prompts import check_positive_ints
from lit_smd.datamodules.teacher_cache import (
    FEATURES,
    METADATA_FILE,
    CacheMetadata,
    TeacherCacheError,
    file_sha256,
    recover_interrupted_build,
    tokenizer_fingerprint,
)
from lit_smd.learner import LearnerLayout, learner_hidden_states
from lit_smd.losses.head import at_rows, head_rows, output_head, rows_of
from lit_smd.models import Quantization, check_pretrained_source, load_causal_lm
from lit_smd.rollout import Rollout, generate

__all__ = ["build_teacher_cache", "teacher_topk_logprobs"]

logger = logging.getLogger(__name__)

ModelDType = Literal["auto", "float32", "bfloat16", "float16", "float64"]


@torch.no_grad()
def teacher_topk_logprobs(
    model: PreTrainedModel,
    rollout: Rollout,
    k: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    *,
    layout: LearnerLayout = "shared_prefix",
) -> tuple[Tensor, Tensor]:
    """The teacher's ``k`` largest log-probs at every completion position, teacher-forced, in chunks of rows.

    Args:
        model: The teacher (a Hugging Face causal LM).
        rollout: Trajectories to score (dense view).
        k: Entries kept per position, ``1 <= k <= V``.
        temperature: Temperature of the distribution.
        chunk_size: Rows projected to the vocabulary at a time.
        layout: ``"shared_prefix"`` (a prompt encoded once for the consecutive rows that share it) or ``"per_row"``
            (`lit_smd.learner`).

    Returns:
        ``(ids [B, N, k] long, logprobs [B, N, k] float32)``, sorted by decreasing log-prob; positions past a
        completion's end are not projected and hold zeros (meaningless values).
    """
    head = output_head(model)
    vocab_size = head.weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"top_k must be an integer in [1, vocab size {vocab_size}], got {k!r}")
    hidden = learner_hidden_states(model, rollout, shadow=False, layout=layout).hidden  # [B, N, H]
    kept = head_rows(rollout.completion_mask)  # only the completion tokens reach the vocabulary projection
    rows = rows_of(hidden, kept)[0]  # [M, H]
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    ids, values = [], []
    for start in range(0, rows.shape[0], chunk_size):
        logits = head(rows[start : start + chunk_size]).to(dtype) / temperature  # [C, V]
        top = torch.log_softmax(logits, -1).topk(k, dim=-1)  # [C, k] each
        values.append(top.values)
        ids.append(top.indices)
    shape = rollout.completion_mask.shape  # [B, N]
    return at_rows(torch.cat(ids)[None], kept, shape), at_rows(torch.cat(values)[None], kept, shape)  # [B, N, k] x2


def build_teacher_cache(
    teacher: str | PreTrainedModel,
    data: DistillDataModule,
    output_dir: str,
    top_k: int = 64,
    temperature: float = 1.0,
    max_new_tokens: int = 512,
    num_samples: int = 1,
    top_p: float = 1.0,
    batch_size: int | None = None,
    teacher_revision: str | None = None,
    model_dtype: ModelDType = "auto",
    quantization: Quantization | None = None,
    device: str = "auto",
    chunk_size: int = 1024,
    seed: int = 0,
    overwrite: bool = False,
) -> CacheMetadata:
    """Sample teacher trajectories for every prompt of ``data`` and write them with top-k teacher log-probs.

    This is the ``lit-smd cache-teacher`` command. The cache is complete and checksummed when this returns; an error
    part-way leaves ``output_dir`` as it was.

    Args:
        teacher: The teacher: hub id / local directory, or a loaded model (used on its device).
        data: The prompts (every prompt, probe set included, in order).
        output_dir: Folder of the cache; must not exist unless ``overwrite``.
        top_k: Teacher log-probs kept per position.
        temperature: Sampling temperature, and the temperature of the stored log-probs (train at the same one).
        max_new_tokens: Longest trajectory (cache at the top of a length curriculum: training truncates).
        num_samples: Trajectories per prompt.
        top_p: Nucleus sampling mass.
        batch_size: Prompts per generation batch; None uses ``data.batch_size``.
        teacher_revision: Hub revision of the teacher to load (and record).
        model_dtype: Teacher parameter dtype when loaded from a path.
        quantization: Load the teacher in bitsandbytes ``"8bit"`` / ``"4bit"`` (CUDA only).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ignored for a loaded model.
        chunk_size: Rows projected to the vocabulary at a time when scoring.
        seed: Seed of the sampling.
        overwrite: Replace an existing cache at ``output_dir`` (kept until the new one is complete).

    Returns:
        The cache's metadata (``bytes_per_token`` among it).

    Raises:
        FileExistsError: ``output_dir`` exists and ``overwrite`` is False, or it is not a cache / empty folder.
        ValueError: Invalid settings (``top_k`` outside ``[1, V]``, ``temperature <= 0``, ...).
    """
    target = Path(output_dir)
    recover_interrupted_build(target)
    _check_target(target, overwrite)
    check_positive_ints({"max_new_tokens": max_new_tokens, "num_samples": num_samples, "chunk_size": chunk_size})
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    if isinstance(teacher, str):
        check_pretrained_source(teacher, "teacher")
        model = load_causal_lm(teacher, dtype=model_dtype, quantization=quantization, revision=teacher_revision)
        if quantization is None:
            model.to(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    else:
        model = teacher
    model.eval()
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be an integer in [1, teacher vocab size {vocab_size}], got {top_k!r}")
    if len(data.tokenizer) > vocab_size:
        raise ValueError(
            f"the tokenizer of `data` has {len(data.tokenizer)} tokens but the teacher only {vocab_size} output ids: "
            "teacher and tokenizer do not belong together"
        )
    configured = getattr(model.generation_config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    data.setup()
    eos_ids = sorted({*data.eos_token_ids, *(i for i in configured if i is not None)})
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    target.parent.mkdir(parents=True, exist_ok=True)
    building = temp_name(target, "building")
    try:
        with staging_dir(target) as staging:
            num_tokens = _write_rows(model, data, staging, building, batch_size, max_new_tokens, temperature, top_p,
                                     num_samples, eos_ids, generator, top_k, chunk_size)  # fmt: skip
        files = {
            path.name: {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
            for path in sorted(building.iterdir())
            if path.is_file()
        }
        num_prompts = len(data.prompt_ids)
        metadata = CacheMetadata(
            teacher=teacher if isinstance(teacher, str) else str(getattr(model, "name_or_path", "") or "<model>"),
            teacher_revision=teacher_revision or getattr(model.config, "_commit_hash", None),
            tokenizer_fingerprint=tokenizer_fingerprint(data.tokenizer),
            vocab_size=vocab_size,
            top_k=top_k,
            temperature=float(temperature),
            top_p=float(top_p),
            max_new_tokens=max_new_tokens,
            num_samples=num_samples,
            seed=seed,
            eos_token_ids=eos_ids,
            num_rows=num_prompts * num_samples,
            num_prompts=num_prompts,
            num_completion_tokens=num_tokens,
            data=_json_safe(_describe(data)),
            files=files,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            versions={
                "torch": torch.__version__, "transformers": transformers.__version__, "lit_smd": _package_version()
            },
        )
        atomic_write_text(building / METADATA_FILE, json.dumps(asdict(metadata), indent=2))
        fsync_tree(building)
        _check_target(target, overwrite)  # again: the folder may have changed during the build
        _move_into_place(building, target)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    logger.info("teacher cache %s: %d trajectories, %.1f bytes/token", target, metadata.num_rows,
                metadata.bytes_per_token)
    return metadata


def _rows_table(rollout: Rollout, ids: Tensor, logprobs: Tensor, prompt_index: Tensor, num_samples: int) -> pa.Table:
    """One Arrow row per trajectory (valid tokens only), from batched tensors."""
    mask = rollout.completion_mask.cpu()  # [B, N]
    lengths = mask.sum(1).numpy()
    prompt_mask = rollout.prompt_mask.cpu()

    def lists(values: np.ndarray, per_row: np.ndarray) -> pa.ListArray:
        offsets = np.concatenate([[0], np.cumsum(per_row)]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    k = ids.shape[-1]
    rows = len(rollout)
    return pa.table(
        {
            "prompt_index": pa.array(prompt_index.cpu().repeat_interleave(num_samples).numpy().astype(np.int32)),
            "sample_index": pa.array(np.tile(np.arange(num_samples, dtype=np.int32), rows // num_samples)),
            "prompt_ids": lists(
                rollout.prompt_ids.cpu()[prompt_mask].numpy().astype(np.int32), prompt_mask.sum(1).numpy()
            ),
            "completion_ids": lists(rollout.completion_ids.cpu()[mask].numpy().astype(np.int32), lengths),
            "completion_logprobs": lists(rollout.logprobs.cpu()[mask].numpy().astype(np.float16), lengths),
            "topk_ids": lists(ids.cpu()[mask].reshape(-1).numpy().astype(np.int32), lengths * k),
            "topk_logprobs": lists(logprobs.cpu()[mask].reshape(-1).numpy().astype(np.float16), lengths * k),
            "finish_reason": pa.array(rollout.finish_reason, pa.string()),
        },
        schema=FEATURES.arrow_schema,
    )


def _write_rows(
    model: PreTrainedModel, data: DistillDataModule, staging: Path, building: Path, batch_size: int | None,
    max_new_tokens: int, temperature: float, top_p: float, num_samples: int, eos_ids: list[int],
    generator: torch.Generator, top_k: int, chunk_size: int,
) -> int:  # fmt: skip
    """Sample and score every prompt batch into ``staging``, then save the dataset to ``building``; token count."""
    device = next(model.parameters()).device
    num_tokens = 0
    with ArrowWriter(features=FEATURES, path=str(staging / "data.arrow")) as writer:
        for batch in data.prompt_batches(batch_size):
            batch = batch.to(device)
            rollout = generate(
                model, batch.prompt_ids, batch.prompt_mask, max_new_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, num_generations=num_samples, eos_token_id=eos_ids, pad_token_id=batch.pad_token_id,
                generator=generator,
            )  # fmt: skip
            ids, logprobs = teacher_topk_logprobs(model, rollout, top_k, temperature, chunk_size)
            writer.write_table(_rows_table(rollout, ids, logprobs, batch.prompt_index, num_samples))
            num_tokens += int(rollout.completion_mask.sum())
        writer.finalize()
    Dataset.from_file(str(staging / "data.arrow")).save_to_disk(str(building))
    return num_tokens


def _check_target(target: Path, overwrite: bool) -> None:
    """Refuse an ``output_dir`` that exists unless ``overwrite`` and it is an empty folder or a lit_smd cache."""
    if not target.exists() and not target.is_symlink():
        return
    if not overwrite:
        raise FileExistsError(
            f"output_dir {target} already exists; pass overwrite=True to replace it (the old cache stays in place "
            "until the new one is complete)"
        )
    refusal = f"output_dir {target} exists and is not a lit_smd teacher cache: refusing to replace it"
    if target.is_symlink() or not target.is_dir():
        raise FileExistsError(f"{refusal} (it is {'a symbolic link' if target.is_symlink() else 'a file'})")
    if not any(target.iterdir()):
        return
    try:
        metadata = CacheMetadata.read(target)
    except TeacherCacheError as error:
        raise FileExistsError(f"{refusal} ({error})") from error
    unlisted = sorted(p.name for p in target.iterdir() if p.name != METADATA_FILE and p.name not in metadata.files)
    if unlisted:
        raise FileExistsError(
            f"{refusal}: it holds {unlisted}, which its {METADATA_FILE} does not list (move them out first)"
        )


def _move_into_place(built: Path, target: Path) -> None:
    """Put ``built`` at ``target``; an existing ``target`` is removed only after the new one is in place.

    One atomic exchange where the OS allows it; otherwise two renames (see the module docstring for the recovery).
    """
    if not target.exists():
        os.replace(built, target)
    elif exchange(built, target):  # ``built`` now holds the old cache
        shutil.rmtree(built)
    else:
        old = temp_name(target, "old")
        os.replace(target, old)
        try:
            os.replace(built, target)
        except OSError:
            os.replace(old, target)
            raise
        shutil.rmtree(old)
    fsync_dir(target.parent)


def _describe(data: DistillDataModule) -> dict[str, Any]:
    """The prompt DataModule's settings; a dataset given as an object is named by its fingerprint."""
    settings = dict(data.hparams)
    if isinstance(data.dataset, Dataset):
        settings["dataset"] = f"<datasets.Dataset fingerprint={data.dataset._fingerprint}, {len(data.dataset)} rows>"
    return settings


def _json_safe(value: Any) -> Any:
    """``value`` with anything JSON cannot hold replaced by its ``repr``."""
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _package_version() -> str:
    try:
        return importlib.metadata.version("lit_smd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
