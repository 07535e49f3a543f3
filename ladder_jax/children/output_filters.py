"""The child process between a multi-process job's native output and the real one (file
descriptor 1 or 2, `processes.start`): `stdout` drops Gloo's connection lines, `stderr` turns
jaxlib's C++ stack on a coordination failure into one line. Standard library only; it runs from
its file, not with `python -m` (which would import jax in every child).

    python -I output_filters.py stdout PIECE ...      # drops lines made only of the pieces"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import time

# Gloo (XLA:CPU's collectives across processes) prints a line per connection to stdout, in
# pieces, from several threads at once: the pieces of two lines can interleave
GLOO = (
    b"[Gloo] Rank ",
    b" is connected to ",
    b" peer ranks. ",
    b"Expected number of connected peer ranks is : ",
)
MET = b"\0ladder-jax-met\0"  # the process writes it to stderr once the job's processes met
FATAL = b"Terminating process because the JAX distributed service"
BURST = re.compile(
    rb"^[IWEF]\d{4} [\d:. ]+\d+ (coordination_service|preemption_sync_manager|client\.h)", re.M
)


class DropLines:
    """Drops whole lines made only of `pieces` (latin-1 text) and numbers, one piece at least;
    holds back a partial last line that may still become one (under 1000 bytes)."""

    def __init__(self, pieces):
        self.pieces = [p.encode("latin-1") for p in pieces]
        self.run = re.compile(b"(?:" + b"|".join(map(re.escape, self.pieces)) + rb"|\d+)*")
        self.held = b""

    def whole(self, line: bytes) -> bool:
        return self.run.fullmatch(line.rstrip(b"\n")) is not None and any(
            p in line for p in self.pieces
        )

    def may_become(self, rest: bytes) -> bool:  # pieces so far, then the start of one
        tail = rest[self.run.match(rest).end() :]
        return any(p.startswith(tail) for p in self.pieces)

    def wait(self):
        return None

    def feed(self, chunk: bytes) -> bytes:
        data = self.held + chunk
        end = data.rfind(b"\n") + 1  # whole lines are judged; the partial last one waits
        lines, rest = data[:end].splitlines(keepends=True), data[end:]
        self.held = rest if rest and len(rest) < 1000 and self.may_become(rest) else b""
        return b"".join(ln for ln in lines if not self.whole(ln)) + (b"" if self.held else rest)

    def end(self) -> bytes:
        return b"" if self.whole(self.held) else self.held


class CondenseFatal:
    """Holds a burst of coordination-service log lines for 2 s: passed on if nothing follows,
    replaced by one line naming what happened if it is jaxlib's fatal end of the process."""

    def __init__(self, pid: int, nproc: int, timeout: int, flags):
        self.pid, self.nproc, self.timeout = pid, nproc, timeout
        self.flags = flags  # how the user sets the coordinator, the processes, the process id
        self.met, self.held, self.fatal, self.since = False, b"", False, None

    def wait(self):
        if self.since is None or self.fatal:
            return None
        return max(0.0, self.since + 2 - time.monotonic())

    def idle(self) -> bytes:
        out, self.held, self.since = self.held, b"", None
        return out

    def feed(self, chunk: bytes) -> bytes:
        if MET in chunk:
            self.met, chunk = True, chunk.replace(MET, b"")
        if self.fatal:
            self.held += chunk
            return b""
        out = b""
        if self.since is None:
            found = BURST.search(chunk)
            if found is None:
                return chunk
            out, chunk, self.since = (
                chunk[: found.start()],
                chunk[found.start() :],
                time.monotonic(),
            )
        self.held += chunk
        self.fatal = FATAL in self.held
        return out

    def end(self) -> bytes:
        return f"error: {self.last_line()}\n".encode() if self.fatal else self.held

    def last_line(self) -> str:
        pid, nproc = self.pid, self.nproc
        coordinator_flag, num_flag, pid_flag = self.flags
        text = self.held.decode("utf-8", "replace")
        tasks = re.search(r"stopped sending heartbeats\):\s*([\d\s,]+)", text)
        peers = (
            sorted({int(x) for x in re.findall(r"\d+", tasks.group(1))} - {pid}) if tasks else []
        )
        if not self.met:
            why = (
                f"the coordinator refused this process: is a {pid_flag} given twice, or "
                f"another job using this {coordinator_flag}?"
            )
            return (
                f"process {pid} of {nproc}: the job's processes did not all meet ({why}): "
                f"start every process with the same {coordinator_flag} and {num_flag} and its "
                f"own {pid_flag} from 0 to {nproc - 1}"
            )
        peers = [p for p in peers if p != pid]
        if peers:
            who = f"process(es) {', '.join(map(str, peers))} stopped answering"
        else:
            who = "lost process 0, the coordinator" if pid else "the job's coordination failed"
        return (
            f"process {pid} of {nproc}: {who} (died, killed or stopped): see its output, then "
            f"start every process of the job again (training resumes from its last "
            f"checkpoint; LADDER_PEER_TIMEOUT={self.timeout} s is the wait)"
        )


def write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def run(filt, read: int = 0, out: int = 1) -> None:
    """Copies `read` to `out` through `filt` (`DropLines` or `CondenseFatal`) until every
    writer of `read` has closed it."""
    while True:
        if not select.select([read], [], [], filt.wait())[0]:
            write(out, filt.idle())
            continue
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        write(out, filt.feed(chunk))
    write(out, filt.end())


def main(argv) -> None:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    which, args = argv[0], argv[1:]
    if which == "stdout":
        run(DropLines(args))
    else:
        pid, nproc, timeout = map(int, args[:3])
        run(CondenseFatal(pid, nproc, timeout, tuple(args[3:6])))


if __name__ == "__main__":
    main(sys.argv[1:])
