"""The offline teacher-logit cache: its format, the checks when loading it, and the DataModule that trains from it.

A cache holds teacher trajectories and their top-k teacher log-probs, built once
(`lit_smd.datamodules.teacher_cache_build.build_teacher_cache`, ``lit-smd cache-teacher``) and trained on offline.
`TeacherCacheDataModule` loads it and yields `CachedBatch`es: the teacher-prefix cells of
`lit_smd.modules.DistillModule` with ``estimator="topk"`` then need no teacher forward at all (the tail of the
distribution is handled by the loss, see `lit_smd.losses.kl_topk.topk_token_kl`).

Format (a `datasets` Arrow dataset written with ``save_to_disk``, plus ``metadata.json``)
    One row per trajectory: ``prompt_index``, ``sample_index`` (int32), ``prompt_ids``, ``completion_ids`` (int32
    lists), ``completion_logprobs`` (float16 list: the teacher's log-prob of each sampled token), ``topk_ids`` (int32,
    ``k`` per token, flattened), ``topk_logprobs`` (float16, flattened) and ``finish_reason`` (``"eos"`` /
    ``"length"``). About ``6 k + 6`` bytes per completion token plus the prompt (390 B at k = 64, against 304 KB for a
    full bfloat16 distribution over Qwen3's 151,936 ids). ``metadata.json`` (`CacheMetadata`) records the teacher and
    its revision, the tokenizer fingerprint, vocabulary size, k, temperature, the generation settings, the prompt
    DataModule's settings, token counts, and the size and SHA-256 of every file.

Safety
    Loading checks everything before training: metadata format; that every file of the folder is listed in
    ``metadata.json`` under a plain name inside the folder (no absolute path, no ``..``, no subfolder, no symbolic
    link), with the Arrow files named by ``state.json`` among them (a file on disk that is not listed, or a
    ``state.json`` that points elsewhere, is refused); file sizes (truncation), checksums (corruption), row and token
    counts, the tokenizer fingerprint against the student's tokenizer; the module then checks the vocabulary size, k
    and temperature (`lit_smd.modules.DistillModule.check_cache`). Loading writes only to finish a build that was
    killed while swapping an old cache for a new one (`recover_interrupted_build`).

Departures
    Log-probs are stored in float16, not bfloat16: over the range of log-probs (``[-65504, 0]``) float16 keeps 3 more
    mantissa bits (a log-prob near -20 is off by at most 0.008).
"""

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_origin

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import Dataset, Features, List, Value, load_from_disk
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lit_smd.atomic import clean_stale, is_stale
from lit_smd.datamodules.distill import PromptBatch, left_pad
from lit_smd.datamodules.prompts import NO_PROBE_PROMPTS, as_tokenizer, check_num_probe_prompts, check_positive_ints
from lit_smd.datamodules.resume import ResumableDataLoader, ResumableDataModule
from lit_smd.rollout import Rollout

__all__ = [
    "CacheMetadata",
    "CachedBatch",
    "TeacherCacheDataModule",
    "TeacherCacheError",
    "load_teacher_cache",
    "recover_interrupted_build",
    "tokenizer_fingerprint",
]

logger = logging.getLogger(__name__)

FORMAT = "lit_smd.teacher_cache"
VERSION = 1
METADATA_FILE = "metadata.json"
STATE_FILE = "state.json"  # written by `datasets.Dataset.save_to_disk`: names the Arrow files
BUILD_KINDS = ("staging", "building", "old")  # the temporary folders of a build (`lit_smd.atomic.temp_name` kinds)
FEATURES = Features(
    {
        "prompt_index": Value("int32"),
        "sample_index": Value("int32"),
        "prompt_ids": List(Value("int32")),
        "completion_ids": List(Value("int32")),
        "completion_logprobs": List(Value("float16")),
        "topk_ids": List(Value("int32")),
        "topk_logprobs": List(Value("float16")),
        "finish_reason": Value("string"),
    }
)


class TeacherCacheError(ValueError):
    """A teacher cache that is missing, incomplete, corrupt, or does not match the student / tokenizer / settings."""


@dataclass(frozen=True)
class CacheMetadata:
    """What a teacher cache holds and how it was made (``metadata.json``).

    Attributes:
        teacher: Hub id or directory of the teacher (or its ``name_or_path`` when passed as a model).
        teacher_revision: Hub revision / commit of the teacher, when known.
        tokenizer_fingerprint: `tokenizer_fingerprint` of the tokenizer the prompts were encoded with.
        vocab_size: Rows of the teacher's output embedding (the length of its distributions).
        top_k: Log-probs kept per position.
        temperature: Temperature of the sampling and of the stored log-probs.
        top_p: Nucleus mass of the sampling (log-probs are of the full distribution regardless).
        max_new_tokens: Longest trajectory.
        num_samples: Trajectories per prompt.
        seed: Seed of the sampling.
        eos_token_ids: Ids that ended trajectories.
        num_rows: Trajectories.
        num_prompts: Prompts.
        num_completion_tokens: Completion tokens over all trajectories.
        data: The prompt DataModule's settings (dataset, template, filtering).
        files: File name -> ``{"bytes": int, "sha256": str}`` for every data file of the cache.
        created: UTC time of the build (ISO 8601).
        versions: lit_smd, torch, transformers versions of the build.
        format: Always ``"lit_smd.teacher_cache"``.
        version: Format version.
    """

    teacher: str
    teacher_revision: str | None
    tokenizer_fingerprint: str
    vocab_size: int
    top_k: int
    temperature: float
    top_p: float
    max_new_tokens: int
    num_samples: int
    seed: int
    eos_token_ids: list[int]
    num_rows: int
    num_prompts: int
    num_completion_tokens: int
    data: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    created: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    @property
    def total_bytes(self) -> int:
        """Bytes of the data files (``metadata.json`` excluded)."""
        return sum(entry["bytes"] for entry in self.files.values())

    @property
    def bytes_per_token(self) -> float:
        """On-disk bytes per completion token, prompts and Arrow overhead included."""
        return self.total_bytes / max(self.num_completion_tokens, 1)

    @classmethod
    def read(cls, path: Path) -> "CacheMetadata":
        """Parse ``path / metadata.json``; `TeacherCacheError` if it is missing or malformed."""
        file = path / METADATA_FILE
        if not file.is_file():
            raise TeacherCacheError(
                f"{path} is not a complete lit_smd teacher cache (no {METADATA_FILE}): the build did not finish, or "
                "the folder holds something else; rebuild it with `lit-smd cache-teacher`"
            )
        try:
            raw = json.loads(file.read_text())
            known = {f.name for f in fields(cls)}
            metadata = cls(**{key: value for key, value in raw.items() if key in known})
        except (json.JSONDecodeError, TypeError, AttributeError) as error:
            raise TeacherCacheError(f"{file} is corrupt ({error}); rebuild the cache") from error
        expected = {f.name: get_origin(f.type) or f.type for f in fields(cls)}  # str | None: a UnionType, unchecked
        mistyped = [
            name
            for name, kind in expected.items()
            if kind in (int, float, str, list, dict)
            and not isinstance(getattr(metadata, name), (int, float) if kind is float else kind)
        ]
        if mistyped:
            raise TeacherCacheError(f"{file} is corrupt (fields {mistyped} have the wrong type); rebuild the cache")
        if metadata.format != FORMAT or metadata.version != VERSION:
            raise TeacherCacheError(
                f"{path}: cache format {metadata.format!r} version {metadata.version} is not {FORMAT!r} version "
                f"{VERSION}; rebuild the cache with this lit_smd"
            )
        return metadata


@dataclass
class CachedBatch:
    """Teacher trajectories with their cached top-k teacher log-probs.

    Attributes:
        prompts: The trajectories' prompts (for student-prefix steps of a mixed run).
        rollout: The teacher trajectories as a dense `lit_smd.rollout.Rollout` (``logprobs``: the teacher's).
        topk_ids: ``[B, N, k]`` int32 teacher top-k ids per completion position, most likely first.
        topk_logprobs: ``[B, N, k]`` float16 teacher log-probs at those ids (padding rows: a uniform top-k).
    """

    prompts: PromptBatch
    rollout: Rollout
    topk_ids: Tensor
    topk_logprobs: Tensor

    def __len__(self) -> int:
        return len(self.rollout)

    def to(self, device: torch.device | str) -> "CachedBatch":
        return replace(
            self,
            prompts=self.prompts.to(device),
            rollout=self.rollout.to(device),
            topk_ids=self.topk_ids.to(device),
            topk_logprobs=self.topk_logprobs.to(device),
        )


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of a tokenizer's token -> id map and special tokens: equal iff token ids mean the same text.

    The chat template is left out (base and instruct variants of a model family share ids but not templates).
    """
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token")},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (the checksums of ``metadata.json``), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_teacher_cache(
    path: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase | None = None,
    verify_checksums: bool = True,
) -> tuple[Dataset, CacheMetadata]:
    """Open a teacher cache after checking that it is complete, intact and made with ``tokenizer``.

    Args:
        path: The cache folder.
        tokenizer: The student's tokenizer; its fingerprint must equal the cache's. None skips that check.
        verify_checksums: Hash every data file (one read of the cache); sizes are always checked.

    Returns:
        The dataset (memory-mapped, read-only use) and its metadata.

    Raises:
        TeacherCacheError: Missing, incomplete, truncated or corrupt cache, files not listed or outside the folder,
            or a tokenizer mismatch.
    """
    path = Path(path)
    recover_interrupted_build(path)
    if not path.is_dir():
        raise TeacherCacheError(f"teacher cache {path} does not exist; build it with `lit-smd cache-teacher`")
    metadata = CacheMetadata.read(path)
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != metadata.tokenizer_fingerprint:
        raise TeacherCacheError(
            f"tokenizer mismatch: the cache {path} was made with another tokenizer (teacher {metadata.teacher!r}, "
            f"vocab size {metadata.vocab_size}) than the `tokenizer` given ({type(tokenizer).__name__} with "
            f"{len(tokenizer)} tokens); distil with the tokenizer the cache was built with, or rebuild the cache"
        )
    check_cache_files(path, metadata, verify_checksums)
    try:
        dataset = load_from_disk(str(path))
    except Exception as error:  # noqa: BLE001  (pyarrow / datasets raise many types for a damaged file)
        raise TeacherCacheError(f"teacher cache {path} cannot be read ({error}); rebuild it") from error
    if not isinstance(dataset, Dataset) or set(dataset.column_names) != set(FEATURES):
        raise TeacherCacheError(f"teacher cache {path} does not hold the expected columns {sorted(FEATURES)}")
    lengths = pc.list_value_length(dataset.data.column("completion_ids"))
    tokens = int(pc.sum(lengths).as_py() or 0)
    if len(dataset) != metadata.num_rows or tokens != metadata.num_completion_tokens:
        raise TeacherCacheError(
            f"teacher cache {path} is inconsistent: {len(dataset)} rows / {tokens} tokens on disk, metadata says "
            f"{metadata.num_rows} / {metadata.num_completion_tokens}; rebuild it"
        )
    topk_values = int(pc.sum(pc.list_value_length(dataset.data.column("topk_ids"))).as_py() or 0)
    if topk_values != tokens * metadata.top_k:
        raise TeacherCacheError(
            f"teacher cache {path} is inconsistent: {topk_values} top-k entries on disk for {tokens} tokens, but "
            f"{METADATA_FILE} says top_k={metadata.top_k}; rebuild it"
        )
    return dataset, metadata


def _is_plain_name(name: str) -> bool:
    """A file name directly inside a folder: no separator, not absolute, not ``.`` / ``..``."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not os.path.isabs(name)
    )


def check_cache_files(path: Path, metadata: CacheMetadata, verify_checksums: bool = True) -> None:
    """Check that the cache folder holds exactly the files ``metadata`` lists, whole, and nothing points outside it.

    Every entry of ``path`` but ``metadata.json`` must be listed in ``metadata.files`` under a plain name (see the
    module docstring), be a regular file (not a symbolic link or folder) of the listed size and, with
    ``verify_checksums``, SHA-256; ``state.json`` must be listed and name only listed files.

    Raises:
        TeacherCacheError: The first problem found, naming the file.
    """
    for name in metadata.files:
        if not _is_plain_name(name):
            raise TeacherCacheError(
                f"teacher cache {path}: {METADATA_FILE} lists the file {name!r}, which is not a plain name inside the "
                "cache folder (absolute paths, '..' and subfolders are refused); rebuild the cache"
            )
    for entry in sorted(path.iterdir()):
        if entry.name != METADATA_FILE and entry.name not in metadata.files:
            raise TeacherCacheError(
                f"teacher cache {path} holds {entry.name}, which {METADATA_FILE} does not list: a cache holds only "
                "the files it lists, each checked by size and SHA-256; remove it or rebuild the cache"
            )
        if entry.is_symlink() or not entry.is_file():
            kind = "a symbolic link" if entry.is_symlink() else "not a regular file"
            raise TeacherCacheError(
                f"teacher cache {path}: {entry.name} is {kind}; a cache holds its own files only; rebuild the cache"
            )
    if STATE_FILE not in metadata.files:
        raise TeacherCacheError(f"teacher cache {path}: {METADATA_FILE} does not list {STATE_FILE}; rebuild the cache")
    for name, entry in metadata.files.items():
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size != entry["bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise TeacherCacheError(
                f"teacher cache {path} is truncated or corrupt: {name} is {found}, {METADATA_FILE} says "
                f"{entry['bytes']} bytes; rebuild the cache"
            )
        if verify_checksums and file_sha256(file) != entry["sha256"]:
            raise TeacherCacheError(f"teacher cache {path} is corrupt: {name} fails its SHA-256 check; rebuild it")
    try:
        data_files = [item["filename"] for item in json.loads((path / STATE_FILE).read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise TeacherCacheError(f"teacher cache {path}: {STATE_FILE} is corrupt ({error!r}); rebuild it") from error
    outside = [name for name in data_files if not _is_plain_name(name) or name not in metadata.files]
    if outside or not data_files:
        raise TeacherCacheError(
            f"teacher cache {path}: {STATE_FILE} names the data files {data_files}, but only files listed in "
            f"{METADATA_FILE} inside the cache folder are read ({outside or 'none named'} refused); rebuild the cache"
        )


def recover_interrupted_build(path: Path) -> None:
    """Finish what a killed `build_teacher_cache` left next to ``path``: restore the old cache, drop temporaries.

    A build swaps a new cache in with one atomic exchange where the OS allows it (Linux), otherwise with two renames
    (old cache aside to ``.<name>.lit_smd-old-<host>-<pid>-<hex>``, new one into place): a build killed between them
    leaves no cache at ``path``; the set-aside cache is renamed back here. Then the staging / building / set-aside
    folders of builds whose process is gone are removed (names made by `lit_smd.atomic.temp_name` for ``path`` only).
    """
    parent = path.parent
    if not parent.is_dir():
        return
    stale = [p for p in sorted(parent.iterdir()) if p.is_dir() and is_stale(p, path.name, BUILD_KINDS)]
    if not path.exists() and not path.is_symlink():
        aside = [p for p in stale if ".lit_smd-old-" in p.name]
        if aside:
            newest = max(aside, key=lambda p: p.stat().st_mtime)
            os.replace(newest, path)
            logger.warning("teacher cache %s: restored the old cache that an interrupted build had set aside", path)
    clean_stale(parent, path.name, BUILD_KINDS)


class TeacherCacheDataModule(ResumableDataModule):
    """Cached teacher trajectories and top-k log-probs for training with no teacher forward (see the module docstring).

    Everything is checked in `setup`, before the first step: the cache (`load_teacher_cache`) against ``tokenizer``;
    the module then checks vocabulary size, k and temperature against `metadata`. The last ``num_probe_prompts``
    prompts (all their trajectories) are held out as the curriculum's probe set. Checkpoints hold the position in the
    epoch and every rank's RNG streams, so ``fit(ckpt_path=...)`` continues exactly (`lit_smd.datamodules.resume`).

    Args:
        path: The cache folder written by ``lit-smd cache-teacher`` (`build_teacher_cache`).
        tokenizer: The student's tokenizer, or its hub id / local directory; must be the cache's.
        batch_size: Trajectories per batch.
        num_probe_prompts: Prompts held out for the entropy probe (0: no probe set).
        shuffle: Shuffle trajectories every epoch (a permutation seeded by ``seed + epoch``).
        seed: Seed of the shuffling.
        verify_checksums: Hash the cache files at setup (one read); sizes are always checked.
    """

    def __init__(
        self,
        path: str,
        tokenizer: str | PreTrainedTokenizerBase,
        batch_size: int = 8,
        num_probe_prompts: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        verify_checksums: bool = True,
    ) -> None:
        super().__init__()
        check_positive_ints({"batch_size": batch_size})
        check_num_probe_prompts(num_probe_prompts)
        self.save_hyperparameters(ignore=[] if isinstance(tokenizer, str) else ["tokenizer"])
        self.path = Path(path)
        self.tokenizer = as_tokenizer(tokenizer)
        self.batch_size = batch_size
        self.num_probe_prompts = num_probe_prompts
        self.shuffle = shuffle
        self.seed = seed
        self.verify_checksums = verify_checksums
        self.dataset: Dataset | None = None
        self.metadata: CacheMetadata | None = None
        self.train_rows: list[int] = []
        self.probe_rows: list[int] = []

    def setup(self, stage: str | None = None) -> None:
        """Load and check the cache and split off the probe prompts (idempotent)."""
        if self.dataset is not None:
            return
        dataset, metadata = load_teacher_cache(self.path, self.tokenizer, self.verify_checksums)
        prompt_index = dataset.data.column("prompt_index").to_numpy()
        probe_prompts = np.unique(prompt_index)[::-1][: self.num_probe_prompts]
        is_probe = np.isin(prompt_index, probe_prompts)
        self.train_rows = np.flatnonzero(~is_probe).tolist()
        # One trajectory per probe prompt: the probe only needs the prompts.
        _, first = np.unique(prompt_index, return_index=True)
        self.probe_rows = sorted(int(row) for row in first if is_probe[row])
        if not self.train_rows:
            raise ValueError(
                f"the cache {self.path} has {metadata.num_prompts} prompts: holding out num_probe_prompts="
                f"{self.num_probe_prompts} leaves none to train on"
            )
        self.dataset, self.metadata = dataset.with_format("arrow"), metadata

    def collate(self, rows: Sequence[int]) -> CachedBatch:
        """The trajectories ``rows`` as one padded `CachedBatch` (prompts left-padded, completions right-padded)."""
        self.setup()
        table = self.dataset[list(rows)]  # pa.Table
        k = self.metadata.top_k
        pad = self.tokenizer.pad_token_id
        eos_ids = tuple(self.metadata.eos_token_ids)  # student completions stop where the teacher's did
        prompts = [seq.values.to_numpy() for seq in table.column("prompt_ids").combine_chunks()]
        prompt_ids, prompt_mask = left_pad(prompts, pad)
        lengths = pc.list_value_length(table.column("completion_ids")).to_numpy(zero_copy_only=False)
        mask = np.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]  # [B, N]
        completion_ids = _padded(table, "completion_ids", mask, (), pad, np.int64)
        logprobs = _padded(table, "completion_logprobs", mask, (), 0.0, np.float32)
        # Padding rows get a valid uniform top-k so that no NaN reaches the (masked) loss terms.
        topk_ids = _padded(table, "topk_ids", mask, (k,), np.arange(k, dtype=np.int32), np.int32)
        topk_logprobs = _padded(table, "topk_logprobs", mask, (k,), -math.log(k), np.float16)
        prompt_index = torch.from_numpy(table.column("prompt_index").to_numpy().astype(np.int64))
        prompt_batch = PromptBatch(prompt_ids, prompt_mask, prompt_index, eos_ids, pad)
        rollout = Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=torch.from_numpy(completion_ids),
            completion_mask=torch.from_numpy(mask),
            logprobs=torch.from_numpy(logprobs),
            finish_reason=table.column("finish_reason").to_pylist(),
        )
        return CachedBatch(prompt_batch, rollout, torch.from_numpy(topk_ids), torch.from_numpy(topk_logprobs))

    def train_dataloader(self) -> ResumableDataLoader:
        self.setup()
        return ResumableDataLoader(
            self.train_rows,
            self,
            self.seed,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            collate_fn=self.collate,
        )

    def probe_batch(self) -> PromptBatch:
        """The held-out probe prompts, for the curriculum's entropy probe."""
        self.setup()
        if not self.probe_rows:
            raise ValueError(NO_PROBE_PROMPTS)
        return self.collate(self.probe_rows).prompts


def _padded(
    table: pa.Table, column: str, mask: np.ndarray, inner: tuple[int, ...], fill: Any, dtype: type
) -> np.ndarray:
    """A flattened list column as ``[B, N, *inner]``, ``fill`` where ``mask`` is False."""
    values = table.column(column).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    out = np.empty((*mask.shape, *inner), dtype=dtype)
    out[...] = fill
    out[mask] = values.reshape(-1, *inner)
    return out
