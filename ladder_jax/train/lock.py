"""One writer per run directory: `RunLock(run_path)` holds `<run>/.lock` (`fcntl.flock`) while a
trainer runs. How it behaves: docs/training.md, 'Resume, one writer, faults'.

    with RunLock("runs/tiny") as lock:      # RunBusy (a UsageError) if another trainer holds it"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from ladder_jax.config import UsageError

LOCK_FILE = ".lock"


class RunBusy(UsageError):
    """Another live trainer holds the run directory."""


class RunLock:
    def __init__(self, run_path: str):
        self.run_path = os.path.abspath(run_path)
        self.file = os.path.join(self.run_path, LOCK_FILE)
        self.fd = None
        self.stale = None  # the holder {host, pid, started} a dead process left, if any
        self.created = []  # the directories acquire() made, deepest first

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if not os.path.isdir(self.run_path):
            missing, d = [], self.run_path
            while not os.path.isdir(d):
                missing.append(d)
                d = os.path.dirname(d)
            for d in reversed(missing):  # outermost first; only what this process made counts
                try:
                    os.mkdir(d)
                except FileExistsError:  # a trainer started at the same moment made it
                    continue
                self.created.insert(0, d)
        for _ in range(10):  # the file may be removed by its releasing holder under us: retry
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = _holder(fd)
                os.close(fd)
                self._cleanup_dir()
                who = (
                    f"pid {holder.get('pid')} on host {holder.get('host')}, started "
                    f"{holder.get('started')}"
                    if holder
                    else "another process"
                )
                raise RunBusy(
                    f"{self.run_path} is in use by another trainer ({who}): wait for "
                    f"it to finish, stop it, or give this run a new name="
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.file).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # locked a file its holder had just removed
                os.close(fd)
                continue
            self.stale = _read(fd) or None
            me = json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }
            ).encode()
            os.pwrite(fd, me, 0)  # written over the old holder, then cut: never read empty
            os.ftruncate(fd, len(me))
            self.fd = fd
            return
        raise RunBusy(f"{self.file}: could not take the lock (it keeps being replaced)")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.file)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        """Removes the directories this lock created (the run's, and any parents such as
        run_dir itself), as long as nothing else was written there."""
        while self.created:
            try:
                os.rmdir(self.created[0])
            except OSError:
                return
            self.created.pop(0)


def _holder(fd, wait_s: float = 2.0) -> dict:
    """The live holder's {host, pid, started}, read from a file someone else has locked. A
    trainer that has just taken the lock writes its name a moment later, over the name of the
    one before it: until then the file reads empty, half-written, or names a process of this
    host that no longer runs. Waits up to `wait_s` for a current name; {} if none comes."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = _read(fd)
        if holder.get("pid") is not None and not _gone(holder):
            return holder
        if time.monotonic() > deadline:
            return {}
        time.sleep(0.01)


def _gone(holder: dict) -> bool:
    """Whether `holder` names a process of this host that is no longer running."""
    if holder.get("host") != socket.gethostname():
        return False  # another host's process: nothing to check it against
    try:
        os.kill(int(holder["pid"]), 0)
    except (ValueError, TypeError, ProcessLookupError):
        return True
    except PermissionError:  # runs, as another user
        return False
    return False


def _read(fd) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}
