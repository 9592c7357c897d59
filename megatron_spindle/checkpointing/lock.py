"""An exclusive lock on a ``--save`` folder, so that two jobs never write the same checkpoints.

``fcntl.flock`` on ``<save>/.spindle.lock``: the kernel releases it when the holder exits, however it exits, so a
crashed job never leaves a stale lock behind. The file names the holder (host, pid, start time, command) for the
error a second job prints. On release the file is removed (with the lock held; an acquirer that opened the old
file notices that the path now names another file, or none, and retries), and a folder the lock created is
removed again when nothing else was written into it, so a run that fails before its first save leaves the
disk as it found it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from pathlib import Path

from megatron_spindle.checkpointing.checkpoint import CheckpointError

LOCK_FILE = ".spindle.lock"


class SaveFolderLocked(CheckpointError):
    """Another job holds the lock on the folder."""


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


class SaveFolderLock:
    def __init__(self, folder: str | Path, flag: str = "--save"):
        self.folder, self.flag = Path(folder), flag
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None
        self._created: list[Path] = []

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise SaveFolderLocked naming the holder. Creates the folder if needed."""
        import fcntl

        if self.folder.exists() and not self.folder.is_dir():
            raise CheckpointError(f"{self.flag} {self.folder} is a file, not a folder")
        missing, d = [], self.folder.absolute()
        while not d.exists():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            d.mkdir(exist_ok=True)
            self._created.append(d)
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
                os.close(fd)
                self._remove_created()
                raise SaveFolderLocked(f"{self.flag} {self.folder} is in use by another job ({_holder(text)}; lock "
                                       f"file {self.path}): wait for it to finish or give another {self.flag}") \
                    from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder removed the file between our open and our lock: take the new one
                os.close(fd)
                continue
            info = {"host": socket.gethostname(), "pid": os.getpid(),
                    "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "command": " ".join(sys.argv)}
            data = json.dumps(info).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            self._fd = fd
            return
        raise SaveFolderLocked(f"{self.flag} {self.folder}: could not take the lock {self.path} (it keeps changing)")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        """Folders this lock created, if they are empty again (a run that failed before writing anything)."""
        for d in reversed(self._created):
            with contextlib.suppress(OSError):
                d.rmdir()
        self._created.clear()

    def __enter__(self) -> SaveFolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
