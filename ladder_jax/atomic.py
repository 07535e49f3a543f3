"""Writes that appear whole or not at all (exports, converted models, results): into a temporary
sibling of the destination, renamed into place once complete; on any failure the temporary is
removed and the destination untouched.

    with atomic.directory("exported/") as tmp: write_everything(tmp)"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile

from ladder_jax.config import ConfigError

_REASONS = {
    os.strerror(code): code
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EROFS, errno.EIO)
}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The permission bits `open(path, "w")` gives a new file under this process's umask."""
    return 0o666 & ~_umask()


def as_os_error(e: Exception, file: str | None = None) -> OSError:
    """`e`, raised by a library writing `file` (safetensors, orbax, tensorstore), as the
    OSError it stands for: the errno its message names ("No space left on device", "os error
    28"), else EIO with the message's first line."""
    if isinstance(e, OSError):
        return e
    text = str(e)
    code = next((c for reason, c in _REASONS.items() if reason in text), None)
    if code is None and (m := re.search(r"os error (\d+)", text)):
        code = int(m.group(1))
    if code is None:
        first = (text.strip().splitlines() or [type(e).__name__])[0]
        return OSError(errno.EIO, first[:200], file)
    return OSError(code, os.strerror(code), file)


@contextlib.contextmanager
def directory(out: str):
    """Yields an empty temporary directory beside `out`; once the block ends without an
    error it becomes `out` (an existing empty `out` is replaced). Removed on any error."""
    if not os.fspath(out).strip():
        raise ValueError("no directory to write: the path is empty")
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0o700
        if os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str, text: str) -> None:
    """`path` holds `text` (UTF-8), or, on any error, what it held before."""
    path = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.partial-", dir=os.path.dirname(path)
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_writable(path: str, what: str) -> None:
    """A one-line ConfigError (naming `what`, e.g. "run_dir='runs'") unless files can be
    created in `path` (or, where it does not exist yet, in its nearest existing parent): said
    before data is loaded or anything is compiled. Probes with a temporary file (removed at
    once), which catches read-only mounts and permissions, the superuser's included."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise ConfigError(f"{what}: {p} is a file, not a directory: give a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=p, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"{what}: cannot write in {p} ({e.strerror}): give a writable "
            f"directory or fix its permissions"
        ) from None
