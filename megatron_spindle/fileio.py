"""Atomic file writes: a temporary file in the same folder, fsync, rename, fsync the folder.

A crash at any point leaves either the old file or the new one, never half of either (plans, checkpoint
pointers). Files get the usual permissions (0666 less the umask, or the mode of the file they replace), not
the 0600 of ``mkstemp``.

Entry points that write several outputs check every output path first (``check_output_file``) and write them
through ``staged_outputs``: each output goes to a temporary file next to it, and only when all are written are
they renamed into place, so a failure on the last output leaves the earlier ones untouched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

PICTURE_SUFFIXES = (".png", ".pdf", ".svg")  # what the Gantt charts are drawn as (matplotlib)


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (best effort: some filesystems refuse to fsync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (changing it races with threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode_for(path: str | Path) -> int:
    """The mode a new version of ``path`` gets: the old file's, else 0666 less the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return 0o666 & ~current_umask()


def _temp_file(path: Path) -> tuple[int, str]:
    """A temporary file next to ``path`` (same filesystem, so the rename is atomic), keeping its suffix so
    that writers which infer the format from the name (matplotlib) see the right one."""
    return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")


def _commit(tmp: str, path: Path) -> None:
    os.chmod(tmp, file_mode_for(path))
    os.replace(tmp, path)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _commit(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def check_output_file(path: str | Path, flag: str, suffixes: tuple[str, ...] | None = None) -> Path:
    """Raise ValueError naming ``flag`` when ``path`` cannot be written as a file: it is a folder, a parent is a
    file, the nearest existing folder is not writable, or its suffix is not one of ``suffixes``. Writes nothing."""
    p = Path(path)
    if not str(path):
        raise ValueError(f"{flag}: empty path")
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder, not a file")
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {path}: unsupported file type '{p.suffix or '(none)'}' (use one of "
                         f"{', '.join(suffixes)})")
    _check_writable_parent(p.absolute().parent, path, flag)
    return p


def check_output_folder(path: str | Path, flag: str) -> Path:
    """Raise ValueError naming ``flag`` when ``path`` cannot be (or become) a folder we write in."""
    p = Path(path)
    if not str(path):
        raise ValueError(f"{flag}: empty path")
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")
    _check_writable_parent(p.absolute(), path, flag)
    return p


def _check_writable_parent(folder: Path, path: str | Path, flag: str) -> None:
    """The nearest existing folder at or above ``folder`` is a folder we may create files in."""
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write in {folder} (permission denied)")


class StagedOutputs:
    """Outputs written to temporary files next to their final names, renamed into place together by
    ``commit`` (or removed by ``abort``)."""

    def __init__(self):
        self._staged: list[tuple[str, Path]] = []
        self._made: list[Path] = []  # folders created for the outputs (removed again by abort)

    def path(self, final: str | Path) -> Path:
        """A temporary path to write ``final``'s content to (created empty, same folder and suffix)."""
        final = Path(final)
        missing = []
        d = final.absolute().parent
        while not d.exists():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            d.mkdir()
            self._made.append(d)
        fd, tmp = _temp_file(final)
        os.close(fd)
        self._staged.append((tmp, final))
        return Path(tmp)

    def write_text(self, final: str | Path, text: str) -> None:
        tmp = self.path(final)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def commit(self) -> None:
        folders = set()
        for tmp, final in self._staged:
            _commit(tmp, final)
            folders.add(final.parent)
        self._staged.clear()
        self._made.clear()
        for d in folders:
            fsync_dir(d)

    def abort(self) -> None:
        for tmp, _ in self._staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._staged.clear()
        for d in reversed(self._made):
            with contextlib.suppress(OSError):
                d.rmdir()
        self._made.clear()


@contextlib.contextmanager
def staged_outputs() -> Iterator[StagedOutputs]:
    """``with staged_outputs() as out: draw(out.path(a)); out.write_text(b, ...)``: both appear at the end of
    the block, or neither (temporary files removed) when it raises."""
    stage = StagedOutputs()
    try:
        yield stage
    except BaseException:
        stage.abort()
        raise
    stage.commit()
