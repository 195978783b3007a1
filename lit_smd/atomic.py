"""Crash-safe writes: a file or folder appears under its final name complete, or not at all.

Algorithm
    `atomic_write` writes to a temporary file in the destination's own folder (so the final rename never crosses a
    filesystem), flushes and ``fsync``\\ s it, renames it over the destination with ``os.replace`` (atomic on POSIX and
    Windows) and ``fsync``\\ s the folder so that the rename itself survives a power cut. A process killed at any
    moment leaves either the old file or the new one under the final name, plus at worst a temporary file.

    Temporary names carry the writer's host and process id: ``.<name>.lit_smd-<kind>-<host>-<pid>-<8 hex>`` (host: 6
    hex digits of the host name's SHA-1). `clean_stale` removes only names of that pattern made on this host by a
    process that is gone (a killed writer), so nothing another program, host or live writer made is ever deleted.

Errors
    A write that the destination's filesystem refuses (disk full, quota, read-only, no permission) raises one
    `WriteError` naming the file, its folder and the cause in plain words (for a full disk: the bytes needed, when the
    caller knows them, and the bytes free), whatever the writer wrapped the ``OSError`` in (``torch.save`` reports a
    full disk as ``unexpected pos``). The temporary file is removed first; a removal that fails too is logged, never
    raised over the first error.

Departures
    ``fsync`` of a folder is skipped where the OS does not allow it (Windows); the rename is still atomic there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "WriteError",
    "atomic_write",
    "atomic_write_text",
    "clean_stale",
    "exchange",
    "fsync_dir",
    "fsync_tree",
    "is_stale",
    "publish_dir",
    "staging_dir",
    "temp_name",
]

logger = logging.getLogger(__name__)

_TEMP = re.compile(r"^\.(?P<name>.+)\.lit_smd-(?P<kind>[a-z]+)-(?P<host>[0-9a-f]{6})-(?P<pid>\d+)-[0-9a-f]{8}$")
HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


_REFUSALS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


class WriteError(OSError):
    """The filesystem refused a write (disk full, quota, read-only, permission): `str` names the file, the folder and
    the cause; ``errno`` is the refusal's, ``original`` the ``OSError`` behind it. Nothing under the final name was
    touched."""

    def __init__(self, message: str, original: OSError) -> None:
        super().__init__(original.errno, message)
        self.message = message
        self.original = original

    def __str__(self) -> str:
        return self.message


def _refusal(error: BaseException) -> OSError | None:
    """The first ``OSError`` of a refusal kind (`_REFUSALS`) in ``error``'s chain of causes and contexts, or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _REFUSALS:
            return error
        error = error.__cause__ or error.__context__
    return None


def _explain(refusal: OSError, final: Path, what: str, needed: Callable[[], int] | None) -> WriteError:
    """The `WriteError` for ``refusal`` met while writing ``final``."""
    folder = final.parent
    cause = _REFUSALS[refusal.errno]
    if refusal.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(_existing(folder)).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        size = ""
        if needed is not None:
            with contextlib.suppress(Exception):
                size = f"at least {needed():,} bytes needed, "
        detail = f"{cause} while writing {what} {final} (folder {folder}): {size}{free}"
        fix = "free some space or write to another folder"
    else:
        at = refusal.filename
        where = f" (at {at})" if at and Path(at).parent != folder and Path(at) != folder else ""
        detail = f"cannot write {what} {final}: {cause} in folder {folder}{where}"
        fix = "make the folder writable or write to another folder"
    message = f"{detail}; nothing was written under that name and older files are untouched. Fix: {fix}"
    return WriteError(message, refusal)


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def temp_name(final: Path, kind: str = "tmp") -> Path:
    """A fresh temporary sibling of ``final``: ``.<name>.lit_smd-<kind>-<host>-<pid>-<8 hex>`` in the same folder."""
    return final.parent / f".{final.name}.lit_smd-{kind}-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's) or cannot tell: keep its files
    return True


def is_stale(path: Path, final_name: str | None = None, kinds: tuple[str, ...] | None = None) -> bool:
    """Whether ``path`` is a temporary name made by `temp_name` on this host whose writing process is gone.

    Args:
        path: A file or folder.
        final_name: Only temporaries of this final name (any when None).
        kinds: Only these kinds (any when None).
    """
    match = _TEMP.match(path.name)
    if match is None or (final_name is not None and match["name"] != final_name):
        return False
    if (kinds is not None and match["kind"] not in kinds) or match["host"] != HOST:
        return False
    return not _pid_alive(int(match["pid"]))


def clean_stale(directory: Path, final_name: str | None = None, kinds: tuple[str, ...] | None = None) -> list[Path]:
    """Delete the temporaries of killed writers in ``directory`` (see `is_stale`); returns what was removed."""
    removed = []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        if not is_stale(path, final_name, kinds):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # read-only folder, no permission: reported below
                path.unlink()
        if path.exists() or path.is_symlink():
            logger.warning("could not remove %s, left behind by an interrupted write", path)
            continue
        logger.warning("removed %s, left behind by an interrupted write", path)
        removed.append(path)
    return removed


def fsync_dir(directory: Path) -> None:
    """``fsync`` a folder so that renames in it are durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    what: str = "file",
    needed: Callable[[], int] | None = None,
) -> Path:
    """Call ``write(file)`` on a temporary file next to ``path``, then move it into place atomically.

    Args:
        path: The destination (its folder is created if needed).
        write: Writes the content to the open binary file it is given.
        what: What the file is, for error messages ("checkpoint", "config").
        needed: Returns the number of bytes the file needs (an estimate), for the message of a full disk.

    Returns:
        The destination.

    Raises:
        WriteError: The filesystem refused the write (disk full, quota, read-only, permission).
        Whatever else ``write`` raises. Either way the destination is untouched and the temporary file removed.
    """
    final = Path(path)
    temp = temp_name(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, final)
    except BaseException as error:
        _remove_temporary(temp)
        refusal = _refusal(error)
        if refusal is None:
            raise
        raise _explain(refusal, final, what, needed) from None
    fsync_dir(final.parent)
    return final


def _remove_temporary(temp: Path) -> None:
    """Remove ``temp`` if it exists; a failure is logged (the error being handled is the one to report)."""
    try:
        temp.unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        if os.path.lexists(temp):
            logger.warning("could not remove the temporary file %s (%s)", temp, error.strerror)


def atomic_write_text(path: str | os.PathLike[str], text: str, what: str = "file") -> Path:
    """`atomic_write` of UTF-8 text."""
    return atomic_write(path, lambda file: file.write(text.encode()), what, lambda: len(text.encode()))


def fsync_tree(directory: Path) -> None:
    """``fsync`` every file under ``directory`` and the folders themselves (before renaming it into place)."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


@contextlib.contextmanager
def staging_dir(final: Path, kind: str = "staging") -> Iterator[Path]:
    """A fresh temporary sibling folder of ``final`` (`temp_name`), removed on exit if still there."""
    path = temp_name(final, kind)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns:
        True when swapped; False where the OS or filesystem cannot (nothing changed then: fall back to two renames).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


@contextlib.contextmanager
def publish_dir(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Write a folder (an export) in a staging sibling, then publish it: no file under ``final`` is ever partial.

    A new ``final`` appears in one rename. Into an existing ``final`` each file is moved with ``os.replace`` (the
    folder's other files are kept), so every file is whole, old or new, even if the process dies part-way. Staging
    folders of killed exports (`is_stale`) are removed first.

    Yields:
        The staging folder to write into (removed if the body raises).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final.parent, final.name, ("export",))
    with staging_dir(final, "export") as staging:
        yield staging
        fsync_tree(staging)
        if not final.exists():
            os.replace(staging, final)
        else:
            for file in sorted(p for p in staging.rglob("*") if p.is_file()):
                destination = final / file.relative_to(staging)
                destination.parent.mkdir(parents=True, exist_ok=True)
                os.replace(file, destination)
                fsync_dir(destination.parent)
        fsync_dir(final.parent)
