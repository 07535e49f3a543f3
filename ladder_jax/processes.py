"""The plumbing of a job of several processes, once `runtime.setup` has chosen the platform:
bounded waits, the peer watch, native output, exit codes (docs/training.md, 'Many processes
and hosts'). Importing the module does nothing.

    processes.start(coordinator="host0:1234", num_processes=8, process_id=3, cpu=True)
    processes.agree(settings, "model or decoding flags")    # all started alike, else exit 2"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
from jax._src import api as jax_api
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

from ladder_jax.children import output_filters
from ladder_jax.config import ConfigError

# The command-line flags that set a job's processes (`start`'s messages name them; the trainer
# passes its config keys instead).
CLI_FLAGS = ("--coordinator", "--num-processes", "--process-id")
TRAIN_KEYS = ("dist.coordinator_address", "dist.num_processes", "dist.process_id")

_PEERS = {"pid": 0, "nproc": 1, "timeout": 60}
_LAST_WORDS = threading.Lock()  # one line from whichever thread ends the process first
_ALIVE = "ladder_jax_alive/"  # the coordination service's keys of the peer watch
_STDERR = {"child": None}  # the stderr filter, once `start` routed stderr through it


def env_int(name: str) -> int | None:
    """The integer in environment variable `name` (None when unset or empty), else a
    ConfigError naming it."""
    v = os.environ.get(name)
    try:
        return int(v) if v else None
    except ValueError:
        raise ConfigError(f"{name}={v!r} must be an integer") from None


def peer_timeout() -> int:
    """Seconds a process waits for its peers (LADDER_PEER_TIMEOUT, default 60)."""
    t = env_int("LADDER_PEER_TIMEOUT")
    if t is not None and t <= 0:
        raise ConfigError(f"LADDER_PEER_TIMEOUT={t} must be a positive number of seconds")
    return t or 60


def start(
    *,
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    cpu: bool,
    flags: tuple[str, str, str] | None = None,
) -> int | None:
    """Joins this process to its job, when it is one of several (the arguments, else the
    JAX_* variables, else SLURM); returns the number of processes where the arguments or the
    variables set a job (the caller `agree`s on it once the devices are up), else None.
    `flags`: how the user sets the three (default `CLI_FLAGS`), for the messages."""
    flags = tuple(flags or CLI_FLAGS)
    addr = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    nproc = num_processes or env_int("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else env_int("JAX_PROCESS_ID")
    if addr or (nproc or 1) > 1:
        if not addr or nproc is None or pid is None:
            raise ConfigError(
                "several processes need a coordinator address, the number of processes and "
                "this process's id (flags, or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                "JAX_PROCESS_ID)"
            )
        if not 0 <= pid < nproc:
            raise ConfigError(f"process id {pid} must be in [0, {nproc})")
        if cpu:  # first: all jax prints, to the end of the process, goes through the filter
            _filter_output(1, "stdout", [p.decode("latin-1") for p in output_filters.GLOO])
        _initialize(addr, nproc, pid, flags)
        return nproc
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        if cpu:
            _filter_output(1, "stdout", [p.decode("latin-1") for p in output_filters.GLOO])
        jax.distributed.initialize()  # SLURM: everything comes from its environment
        g = jax_distributed.global_state
        _PeerWatch(g.client, g.process_id, g.num_processes, peer_timeout()).start()
    return None


def _filter_output(fd: int, which: str, args: list) -> subprocess.Popen:
    """From now on, what this process writes to native file descriptor `fd` (1 or 2, what C++
    libraries write to as well as Python) goes through the child `output_filters <which>
    <args>` to the real one. The child reads its pipe until this process has wholly ended, in
    a session of its own (Ctrl-C is for this process), so nothing printed is lost."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    read, write = os.pipe()
    real = os.dup(fd)
    child = subprocess.Popen(
        [sys.executable, "-I", output_filters.__file__, which, *map(str, args)],
        stdin=read,
        stdout=real,
        close_fds=True,
        start_new_session=True,
    )
    for end in (read, real):
        os.close(end)
    os.dup2(write, fd)
    os.close(write)
    return child


def _exit_quietly_on_abort() -> None:
    """jaxlib aborts (SIGABRT) after printing its C++ stack: make that `_exit(6)` (SIGABRT's
    number, the same exit code) without the core dump, through libc's own handler table."""
    try:
        libc = ctypes.CDLL(None)
        libc.signal(int(signal.SIGABRT), ctypes.cast(libc._exit, ctypes.c_void_p))
    except (OSError, AttributeError):
        pass


def _message(addr: str, nproc: int, pid: int, t: int, flags: tuple, why: str) -> str:
    return (
        f"process {pid} of {nproc}: the job's processes did not all meet at the "
        f"coordinator {addr} within {t} s ({why}): start every process with the same "
        f"{flags[0]} and {flags[1]} and its own {flags[2]} from 0 to "
        f"{nproc - 1} (LADDER_PEER_TIMEOUT sets the wait)"
    )


def _initialize(addr: str, nproc: int, pid: int, flags: tuple) -> None:
    """jax.distributed.initialize with bounded waits; one ConfigError when the job's other
    processes do not all connect in time (none started, a wrong --num-processes, a process id
    given twice). Then the peer watch runs until the process ends."""
    t = peer_timeout()

    def give_up():  # jaxlib's own timeout ends the process from C++ (a stack, SIGABRT)
        why = "none came, or too few"
        print(f"error: {_message(addr, nproc, pid, t, flags, why)}", file=sys.stderr, flush=True)
        os._exit(2)

    if pid == 0:  # gRPC shares a port between servers: a second process 0 would go unseen
        _check_port_free(addr, lambda why: _message(addr, nproc, pid, t, flags, why))
    _STDERR["child"] = _filter_output(2, "stderr", [pid, nproc, t, *flags])
    _exit_quietly_on_abort()
    timer = threading.Timer(t, give_up)
    timer.daemon = True
    timer.start()
    met = threading.Event()
    threading.Thread(target=_say_waiting, args=(met, addr, nproc, pid, t), daemon=True).start()
    try:  # jaxlib's heartbeat ends a process with a C++ stack: later than the watch below
        jax.distributed.initialize(
            addr, nproc, pid, initialization_timeout=t + 30, heartbeat_timeout_seconds=2 * t + 30
        )
    except Exception as e:  # noqa: BLE001 (jaxlib's errors have no public classes)
        raise ConfigError(_message(addr, nproc, pid, t, flags, _first_line(e))) from None
    finally:
        timer.cancel()
        met.set()
    sys.stderr.flush()  # tells the stderr filter the processes have met
    os.write(2, output_filters.MET)
    _PeerWatch(jax_distributed.global_state.client, pid, nproc, t).start()


def _say_waiting(met: threading.Event, addr: str, nproc: int, pid: int, t: int) -> None:
    """Progress while the processes meet: a line after a few seconds, then every 15 s, until
    they have met or the wait ends."""
    start, first = time.monotonic(), min(3.0, t / 4)
    if met.wait(first):
        return
    print(
        f"process {pid} of {nproc}: waiting for the other processes at {addr} (up to {t} s; "
        f"LADDER_PEER_TIMEOUT sets the wait)",
        file=sys.stderr,
        flush=True,
    )
    while not met.wait(15.0):
        waited = time.monotonic() - start
        if waited >= t:
            return
        print(
            f"process {pid} of {nproc}: still waiting, {waited:.0f} of {t} s",
            file=sys.stderr,
            flush=True,
        )


def _check_port_free(addr: str, message) -> None:
    """A ConfigError (through `message`) when the coordinator's port is taken on this host."""
    port = int(addr.rsplit(":", 1)[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a listener, not TIME_WAIT
        try:
            sock.bind(("", port))
        except OSError as e:
            raise ConfigError(
                message(
                    f"port {port} is taken here ({e.strerror}): another process 0 (a --process-id "
                    f"given twice) or another job on this --coordinator"
                )
            ) from None


def _first_line(error) -> str:
    text = str(error or "").strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


class _PeerWatch:
    """Every process writes a counter to the coordination service's key-value store about once
    a second and reads everyone's: a peer whose counter has not moved for `timeout` seconds
    (dead, killed, stopped), or a coordinator this process cannot reach that long, ends this
    process with one line naming it and exit code 1, whatever the main thread is blocked in
    (a collective, a checkpoint barrier). It beats until the process really ends (a process
    done early waits for its peers in jax's shutdown barrier, alive)."""

    def __init__(self, client, pid: int, nproc: int, timeout: int):
        self.client, self.pid, self.nproc, self.timeout = client, pid, nproc, timeout
        self.beat = min(1.0, timeout / 10)
        self.ok = time.monotonic()  # when the coordinator last answered; None: stopped
        self.seen = {}  # peer -> (its last counter, when it changed)
        self.leaving = self.stop = False
        self.threads = [
            threading.Thread(target=f, name=f"peer-watch-{f.__name__}", daemon=True)
            for f in (self.beats, self.check)
        ]
        self.jax_exit = getattr(jax_api, "clean_up", None)

    def start(self) -> None:
        _PEERS.update(pid=self.pid, nproc=self.nproc, timeout=self.timeout)
        # jax's own exit work (backends, then the shutdown barrier) runs inside `exiting`, so
        # the beats go on through the barrier and are then stopped and joined: a daemon thread
        # still inside the coordination client when the interpreter finalizes aborts it.
        if self.jax_exit is not None:
            atexit.unregister(self.jax_exit)
        atexit.register(self.exiting)
        for thread in self.threads:
            thread.start()

    def lost(self, who: str):
        _LAST_WORDS.acquire()
        print(
            f"error: process {self.pid} of {self.nproc}: {who} (died, killed or stopped): see "
            f"its output, then start every process of the job again (training resumes from its "
            f"last checkpoint; LADDER_PEER_TIMEOUT={self.timeout} s is the wait)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def beats(self):
        count = 0
        while not self.stop:
            count += 1
            try:
                self.client.key_value_set(f"{_ALIVE}{self.pid}", str(count), allow_overwrite=True)
                values = dict(self.client.key_value_dir_get(_ALIVE))
            except Exception:  # noqa: BLE001 (jaxlib's errors have no public classes)
                if self.leaving:  # jax's client is shut down: nothing more to watch
                    self.ok = None
                    return
                values = None
            now = time.monotonic()
            if values is not None:
                self.ok = now
                for key, value in values.items():
                    peer = int(key.rsplit("/", 1)[-1])
                    if self.seen.get(peer, (None,))[0] != value:
                        self.seen[peer] = (value, now)
            time.sleep(self.beat)
        self.ok = None

    def check(self):
        start, t = time.monotonic(), self.timeout
        while self.ok is not None:
            time.sleep(self.beat)
            now, ok = time.monotonic(), self.ok
            if ok is not None and now - ok > t:
                self.lost(f"no answer from the coordinator, process 0, for {t} s")
            stale = [
                p
                for p in range(self.nproc)
                if p != self.pid and now - self.seen.get(p, (None, start))[1] > t
            ]
            if stale:
                self.lost(f"process(es) {', '.join(map(str, stale))} stopped answering for {t} s")

    def exiting(self):
        self.leaving = True
        try:
            if self.jax_exit is not None:
                self.jax_exit()
        finally:
            self.stop = True
            self.threads[0].join(timeout=max(5.0, 3 * self.beat))


def collective_failed(error: BaseException) -> None:
    """In a job of several processes (nothing otherwise), ends the process after an error from
    jax (a collective whose peer died: Gloo's connection reset): the watch's line when a peer
    is gone (within LADDER_PEER_TIMEOUT), else the error's first line; exit code 1 either way,
    without jax's shutdown barrier (which would abort with a C++ stack).

        except jax.errors.JaxRuntimeError as e:
            processes.collective_failed(e)
            raise"""
    if _PEERS["nproc"] <= 1:
        return
    time.sleep(_PEERS["timeout"] + 5)  # the watch ends the process first when a peer is gone
    _LAST_WORDS.acquire()
    print(
        f"error: process {_PEERS['pid']} of {_PEERS['nproc']}: {_first_line(error)} (the "
        f"other processes still answer: see their output)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _first_difference(lead, mine, path=""):
    """(key path, process 0's value, this process's value) of the first difference, or None."""
    if isinstance(lead, dict) and isinstance(mine, dict):
        for k in sorted(set(lead) | set(mine)):
            found = _first_difference(lead.get(k), mine.get(k), f"{path}.{k}" if path else k)
            if found:
                return found
        return None
    return None if lead == mine else (path or "(all)", lead, mine)


def agree(settings: dict, what: str) -> None:
    """Many processes: a ConfigError unless `settings` (JSON-able: what this process loaded and
    how it was asked to run) equal process 0's; the message names the first difference (on
    process 0: which processes differ). Every process must call it at the same point. One
    process: nothing."""
    if jax.process_count() == 1:
        return
    text = json.dumps(settings, sort_keys=True, default=str).encode()
    digest = np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, 32)
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if not differ:
        return
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(text))))
    buf = np.zeros(n, np.uint8)
    if jax.process_index() == 0:
        buf[:] = np.frombuffer(text, np.uint8)
    lead = json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode())
    fix = "start every process of the job with the same flags and files"
    if jax.process_index() == 0:
        raise ConfigError(
            f"process(es) {', '.join(map(str, differ))} were started with another "
            f"{what} than this one, process 0 (each names the difference): {fix}"
        )
    key, a, b = _first_difference(lead, json.loads(text)) or ("(all)", "?", "?")
    raise ConfigError(
        f"process {jax.process_index()} was started with another {what} than "
        f"process 0: {key} is {a!r} there, {b!r} here: {fix}"
    )


@contextlib.contextmanager
def stop_watchdog(what: str):
    """While active (main thread), SIGTERM / SIGINT also reach a watchdog thread (through
    `signal.set_wakeup_fd`, so even while the main thread is blocked in native code, e.g. a
    collective whose peer is gone): a second signal, or the block still active
    LADDER_STOP_GRACE seconds (default 60) after the first, ends the process with one line on
    stderr and exit code 1. The Python handlers, which must be installed, act as before."""
    grace = env_int("LADDER_STOP_GRACE")
    if grace is not None and grace <= 0:
        raise ConfigError(f"LADDER_STOP_GRACE={grace} must be a positive number of seconds")
    grace = grace or 60
    r, w = os.pipe()
    os.set_blocking(w, False)
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    done = threading.Event()
    wanted = {int(signal.SIGTERM), int(signal.SIGINT)}

    def signals(timeout):
        if select.select([r], [], [], timeout)[0]:
            return [b for b in os.read(r, 64) if b in wanted]
        return []

    def watch():
        while not done.is_set():
            got = signals(0.5)
            if not got:
                continue
            deadline = time.monotonic() + grace
            while len(got) < 2 and not done.is_set() and time.monotonic() < deadline:
                got += signals(min(0.5, max(0.0, deadline - time.monotonic())))
            if done.is_set():
                return
            why = "a second signal" if len(got) >= 2 else f"still running {grace} s after it"
            print(
                f"error: {what} stopped by {signal.Signals(got[0]).name} ({why}; blocked, "
                f"e.g. in a collective whose peer stopped): no checkpoint was saved by this "
                f"stop; the last one is kept",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    thread = threading.Thread(target=watch, name="stop-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(old)
        thread.join(2)
        os.close(r)
        os.close(w)
