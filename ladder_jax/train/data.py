"""Training data: text or token files -> packed (seq_len + 1)-token records -> grain pipeline;
each process reads only its shard, and the iterator's state resumes exactly. Sources and
packing: docs/training.md, 'Your own data'.

    train, held_out = split(load_tokens(path, tokenizer), seq_len, eval_fraction)
    it = train_iterator(train, batch=..., seed=..., shard=(i, n))"""

from __future__ import annotations

import glob as globlib
import os
import weakref
from importlib import resources

import grain
import numpy as np

from ladder_jax.config import UsageError


class DataError(UsageError):
    """Data that cannot be used as configured; the message says why and what to change."""


DEFAULT_CORPUS = "devils_dictionary.txt"


def source_files(path: str | None) -> list[str]:
    """The files `path` names: one file, a glob, or every file below a directory (sorted)."""
    if path is None:
        return [str(resources.files("ladder_jax") / "corpus" / DEFAULT_CORPUS)]
    if os.path.isdir(path):
        files = sorted(
            os.path.join(d, f)
            for d, _, fs in os.walk(path)
            for f in fs
            if not f.startswith(".") and os.path.isfile(os.path.join(d, f))
        )
    elif os.path.isfile(path):
        files = [path]
    elif os.path.exists(path):
        raise DataError(
            f"data.path={path!r} is not a regular file (a FIFO, socket or device, "
            f"which would be read forever): give a file, a glob or a directory"
        )
    else:
        files = sorted(f for f in globlib.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise DataError(
            f"data.path={path!r} matches no file (give a file, a glob or a "
            f"directory; leave it unset for the embedded corpus)"
        )
    return files


def load_tokens(
    path: str | None, tokenizer, vocab_size: int | None = None
) -> "np.ndarray | TokenFile":
    """One flat token stream from `path` (see the module docstring). With `vocab_size`, every
    id must lie in [0, vocab_size): pre-tokenized arrays are checked here, since a -1 would
    index the last embedding row and an id past the vocabulary makes the loss NaN."""
    files = source_files(path)
    npy = [f for f in files if f.endswith(".npy")]
    if npy and len(npy) != len(files):
        raise DataError(f"data.path={path!r} mixes .npy arrays and text files: use one kind")
    parts = []
    for f in files:
        if npy:
            parts.append(_load_npy(f, vocab_size))
            continue
        ids = tokenizer.encode(_read_text(f), bos=False)
        frame = [[tokenizer.bos_id]] if tokenizer.bos_id is not None else []
        frame += [ids] + ([[tokenizer.eos_id]] if tokenizer.eos_id is not None else [])
        parts.extend(np.asarray(p, np.int32) for p in frame)
    sizes = [len(p) for p in parts] if npy else [os.path.getsize(f) for f in files]
    if not any(sizes):
        where = files[0] if len(files) == 1 else f"data.path={path!r} ({len(files)} files)"
        raise DataError(f"{where}: empty, no tokens to train on: give a file with data in it")
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _read_text(file: str) -> str:
    """The file as text. Binary files are refused (NUL bytes, or more than 1% of the bytes not
    UTF-8); a few stray invalid bytes become U+FFFD."""
    try:
        with open(file, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise DataError(f"{file}: cannot read it ({e.strerror})") from None
    why = "has NUL bytes" if b"\0" in raw else None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        invalid = len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))
        if invalid > len(raw) // 100:
            why = why or f"has {invalid} of {len(raw)} bytes not UTF-8"
    if why:
        raise DataError(
            f"{file}: {why}, so it is not text: give UTF-8 text files, or pre-tokenized .npy arrays"
        )
    return text


class TokenFile:
    """A 1-D integer `.npy` file read in place: `len()`, and slices read with one `os.pread`
    each (a file that shrinks under a reader is a DataError, not a SIGBUS)."""

    def __init__(self, file: str, dtype: np.dtype, length: int, offset: int):
        self.file, self.dtype, self.length, self.offset = file, dtype, length, offset
        self.fd = os.open(file, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    @classmethod
    def open(cls, file: str) -> "TokenFile":
        try:
            with open(file, "rb") as fh:
                if fh.read(6) != b"\x93NUMPY":
                    raise DataError(
                        f"{file} is not a .npy file (no NUMPY header): save token "
                        f"ids with numpy.save(file, ids), ids a 1-D integer array"
                    )
                fh.seek(0)
                version = np.lib.format.read_magic(fh)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read(fh)
                offset = fh.tell()
        except OSError as e:
            raise DataError(f"{file}: cannot read it ({e.strerror or e})") from None
        except (ValueError, EOFError, SyntaxError) as e:  # a damaged header
            raise DataError(
                f"{file} is damaged ({str(e).splitlines()[0]}): save token ids "
                f"with numpy.save(file, ids), ids a 1-D integer array"
            ) from None
        if dtype.hasobject:
            raise DataError(
                f"{file} holds Python objects, not integers: save token ids with "
                f"numpy.save(file, ids), ids a 1-D integer array"
            )
        if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
            raise DataError(
                f"{file}: pre-tokenized data must be a 1-D integer array, got {dtype}{list(shape)}"
            )
        want, have = offset + shape[0] * dtype.itemsize, os.path.getsize(file)
        if have < want:
            raise DataError(
                f"{file} is damaged (truncated: its header promises {shape[0]} "
                f"tokens, {want} bytes, but the file has {have}): write it again"
            )
        return cls(file, dtype, shape[0], offset)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if not isinstance(index, slice):
            i = int(index) + (self.length if int(index) < 0 else 0)
            if not 0 <= i < self.length:
                raise IndexError(index)
            return self[i : i + 1][0]
        start, stop, step = index.indices(self.length)
        if step != 1:
            raise TypeError("TokenFile reads contiguous slices")
        n = max(stop - start, 0)
        size = n * self.dtype.itemsize
        raw = os.pread(self.fd, size, self.offset + start * self.dtype.itemsize)
        if len(raw) != size:
            raise DataError(
                f"{self.file} was cut short while the run read it (tokens "
                f"{start}..{stop} are gone): restore the file, then run the same "
                f"command again to resume from the last checkpoint"
            )
        return np.frombuffer(raw, self.dtype)

    def __array__(self, dtype=None, copy=None):
        a = self[0 : self.length]
        return a if dtype is None else a.astype(dtype)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()


def _load_npy(file: str, vocab_size: int | None) -> TokenFile:
    """A pre-tokenized array (`TokenFile`), its ids checked against `vocab_size` in chunks."""
    a = TokenFile.open(file)
    if vocab_size is None or not len(a):
        return a
    lo, hi, bad = [], [], 0
    for i in range(0, len(a), 1 << 24):  # bounded memory for any file size
        part = a[i : i + (1 << 24)]
        lo.append(int(part.min()))
        hi.append(int(part.max()))
        bad += int(np.count_nonzero((part < 0) | (part >= vocab_size)))
    lo, hi = min(lo), max(hi)
    if bad:
        fix = []
        if lo < 0:
            fix.append("negative ids (padding, masks) do not belong in a token stream")
        if hi >= vocab_size:
            fix.append(
                f"re-tokenize with the run's data.tokenizer or set model.vocab_size >= {hi + 1}"
            )
        raise DataError(
            f"{file}: {bad} of {len(a)} token ids are outside the model's "
            f"vocabulary [0, {vocab_size}) (smallest {lo}, largest {hi}): " + "; ".join(fix)
        )
    return a


class Records:
    """Random access to the consecutive (seq_len + 1)-token records of a token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int, stop: int):
        self.tokens, self.seq_len, self.start, self.stop = tokens, seq_len, start, stop

    def __len__(self):
        return self.stop - self.start

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        a = (self.start + i) * self.seq_len
        return np.asarray(self.tokens[a : a + self.seq_len + 1], np.int32)


def split(tokens: np.ndarray, seq_len: int, eval_fraction: float):
    """(train records, held-out records): the held-out split is the stream's last records."""
    n = (len(tokens) - 1) // seq_len
    n_eval = int(round(n * eval_fraction))
    if n < 1:
        raise DataError(
            f"{len(tokens)} tokens are fewer than one record of seq_len + 1 = "
            f"{seq_len + 1} tokens: use more data or a shorter data.seq_len"
        )
    if n - n_eval < 1 or (eval_fraction > 0 and n_eval < 1):
        raise DataError(
            f"{len(tokens)} tokens make {n} records of seq_len={seq_len}: too few for a "
            f"held-out fraction of {eval_fraction}; use more data or a shorter seq_len"
        )
    return Records(tokens, seq_len, 0, n - n_eval), Records(tokens, seq_len, n - n_eval, n)


def _batch(ds: grain.MapDataset, batch: int, what: str):
    if len(ds) < batch:
        raise DataError(
            f"{what} has {len(ds)} records of this process's shard, fewer than "
            f"one batch of {batch}: use a smaller batch or seq_len, or more data"
        )
    return ds.batch(batch, drop_remainder=True)


def train_iterator(records: Records, *, batch: int, seed: int, shard: tuple[int, int] = (0, 1)):
    """An endless, seeded, checkpointable iterator of (batch, seq_len + 1) int32 arrays over
    this process's shard (`shard` = (index, count))."""
    i, n = shard
    ds = grain.MapDataset.source(records).shuffle(seed=seed)[i::n]
    _batch(ds, batch, "the training split")  # checks there is at least one batch
    # repeat before batch: the shuffle sees the epoch in the index and reshuffles each epoch
    ds = ds.repeat(None).batch(batch, drop_remainder=True)
    return ds.to_iter_dataset().__iter__()


def eval_batches(
    records: Records, *, batch: int, max_batches: int, shard: tuple[int, int] = (0, 1)
):
    """The held-out split in order: at most `max_batches` (batch, seq_len + 1) arrays."""
    i, n = shard
    ds = _batch(grain.MapDataset.source(records)[i::n], batch, "the held-out split")
    return [ds[k] for k in range(min(len(ds), max_batches))]
