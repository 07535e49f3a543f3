"""Progress lines on stderr for long work where no bar shows (a log file, CI): the first state at
once, then each change at most every `every_s` seconds, and the last state again (with the time
spent) while nothing changes.

    with ProgressLines(every_s=10) as lines: lines.show(f"compiling: {k}/{n} programs")"""

from __future__ import annotations

import threading
import time

from ladder_jax.runtime import write_stderr


class ProgressLines:
    """Lines as the module docstring says; `show` from any thread, `close` (or the `with`
    block's end) stops the repeats."""

    def __init__(self, every_s: float = 10.0, write=write_stderr):
        self.every_s, self.write = every_s, write
        self.start = time.monotonic()
        self.last_line, self.shown, self.last_at = None, None, self.start
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._repeat, name="progress-lines", daemon=True)
        self.thread.start()

    def show(self, line: str, now: bool = False) -> None:
        """Records the state `line`; printed at once when it is the first, `now` (a stage begins
        or ends) or the last print is `every_s` old (else the repeat prints it in time)."""
        with self.lock:
            self.last_line = line
            t = time.monotonic()
            if self.shown is None or now or t - self.last_at >= self.every_s:
                self._print(line, t)

    def _print(self, line: str, now: float) -> None:
        self.shown, self.last_at = line, now
        self.write(line + "\n")

    def _repeat(self) -> None:
        while not self.done.wait(max(0.05, self.last_at + self.every_s - time.monotonic())):
            with self.lock:
                now = time.monotonic()
                if self.last_line is None or now - self.last_at < self.every_s:
                    continue
                line = self.last_line
                if line == self.shown:
                    line += f" ({now - self.start:.0f} s so far)"
                self._print(line, now)
                self.shown = self.last_line

    def close(self) -> None:
        self.done.set()
        self.thread.join(1)

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
