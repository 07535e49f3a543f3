"""Process start-up, the same for every command-line tool, before jax touches a backend.

    runtime.setup(cpu_devices=2)                      # one process
    runtime.setup(coordinator="host0:1234", num_processes=8, process_id=3)

CPU when no NVIDIA device is present; CPU hosts split into fake devices so tensor parallelism
runs for real; `jax.distributed` from the arguments, the JAX_* variables or SLURM; on CPU,
glibc keeps the memory XLA frees between steps (`keep_freed_memory`,
LADDER_JAX_HOST_MALLOC=default turns it off); `quiet()` drops the CUDA plugin's start-up lines
and `hush_missing_cuda()` its "cannot load CUDA" log record on a GPU-less host. Every process
waits at most LADDER_PEER_TIMEOUT seconds (default 60) for its peers; `agree` checks that all
were started alike (exit 2 naming the difference). Nothing here imports jax at import time:
`__init__` imports this first.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time

_NOISE = re.compile(
    r"absl::InitializeLog\(\) is called|cudart_stub\.cc.*cuda drivers"
    r"|Missing deviceless CUB scratch size data"
    r"|To avoid this, compile with a GPU present"
)
_QUIET = {"depth": 0, "saved": None, "tmp": None}
# Gloo (XLA:CPU's collectives across processes) prints one line per connection to stdout
# Gloo (XLA:CPU's collectives across processes) prints a line per connection to stdout, in
# pieces, from several threads at once: the pieces of two lines can interleave
_GLOO = (
    b"[Gloo] Rank ",
    b" is connected to ",
    b" peer ranks. ",
    b"Expected number of connected peer ranks is : ",
)
_QUIET_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet():
    """Filters the CUDA plugin's start-up chatter (and XLA's deviceless-compile warning about
    CUB scratch sizes) out of the process's native stderr. Nested and concurrent uses (threads
    compiling at once) share one capture, filtered when the last one ends."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # captured (pytest, notebooks): leave it
        yield
        return
    with _QUIET_LOCK:
        if _QUIET["depth"] == 0:
            sys.stderr.flush()
            _QUIET["saved"], _QUIET["tmp"] = os.dup(fd), tempfile.TemporaryFile()
            os.dup2(_QUIET["tmp"].fileno(), fd)
        _QUIET["depth"] += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET["depth"] -= 1
            if _QUIET["depth"] == 0:
                sys.stderr.flush()
                saved, tmp = _QUIET["saved"], _QUIET["tmp"]
                os.dup2(saved, fd)
                os.close(saved)
                tmp.seek(0)
                for line in tmp.read().decode("utf-8", "replace").splitlines(keepends=True):
                    if not _NOISE.search(line):
                        sys.stderr.write(line)
                tmp.close()
                sys.stderr.flush()


def write_stderr(text: str) -> None:
    """Writes `text` to the process's stderr now, also while `quiet()` holds it (a progress line
    from the main thread while other threads compile): it goes to the stderr `quiet()` saved,
    not into the capture it filters when the last compile ends."""
    with _QUIET_LOCK:
        saved = _QUIET["saved"] if _QUIET["depth"] else None
        if saved is None:
            sys.stderr.write(text)
            sys.stderr.flush()
        else:
            os.write(saved, text.encode("utf-8", "replace"))


# A child process between this one's native stdout and the real one: lines made only of the
# pieces (argv, latin-1) and numbers are dropped, everything else passes at once, partial lines
# included (a tail that may still become a dropped line is held back). Being a child, it also
# sees what C++ libraries flush at the very end of the process, after Python's exit handlers.
_STDOUT_FILTER = r"""
import os, re, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
pieces = [p.encode("latin-1") for p in sys.argv[1:]]
run = re.compile(b"(?:" + b"|".join(map(re.escape, pieces)) + rb"|\d+)*")
def whole(line):  # a line of pieces (and numbers) only, one piece at least
    return run.fullmatch(line.rstrip(b"\n")) is not None and any(p in line for p in pieces)
def may_become(rest):  # pieces so far, then the start of one
    tail = rest[run.match(rest).end():]
    return any(p.startswith(tail) for p in pieces)
def write(data):
    while data:
        data = data[os.write(1, data):]
held = b""
while chunk := os.read(0, 1 << 16):
    data = held + chunk
    end = data.rfind(b"\n") + 1  # whole lines are judged; the partial last one waits or passes
    lines, rest = data[:end].splitlines(keepends=True), data[end:]
    held = rest if rest and len(rest) < 1000 and may_become(rest) else b""
    write(b"".join(ln for ln in lines if not whole(ln)) + (b"" if held else rest))
if not whole(held):
    write(held)
"""


def drop_stdout_lines(pieces: tuple) -> None:
    """From now on, lines made of `pieces` (bytes) and numbers only are dropped from the
    process's native stdout (fd 1, what C++ libraries print to as well as Python); everything
    else passes at once (a partial line that may still become one waits for its end). A child
    process (`_STDOUT_FILTER`) reads a pipe until this process has wholly ended, so nothing
    printed is lost.

        drop_stdout_lines(_GLOO)   # several CPU processes: Gloo's connection lines"""
    import subprocess

    sys.stdout.flush()
    read, write = os.pipe()
    real = os.dup(1)
    subprocess.Popen(  # a session of its own: Ctrl-C is for this process
        [sys.executable, "-c", _STDOUT_FILTER, *(p.decode("latin-1") for p in pieces)],
        stdin=read,
        stdout=real,
        close_fds=True,
        start_new_session=True,
    )
    for fd in (read, real):
        os.close(fd)
    os.dup2(write, 1)
    os.close(write)


# The command-line flags that set a job's processes (`setup`'s messages name them; the trainer
# passes its config keys instead).
CLI_FLAGS = ("--coordinator", "--num-processes", "--process-id")
TRAIN_KEYS = ("dist.coordinator_address", "dist.num_processes", "dist.process_id")


# A child process between this one's native stderr and the real one, for jobs of several
# processes: jaxlib ends a process whose coordination service failed (its coordinator died) with
# a C++ stack; the child, which outlives it, shows one line instead. Everything else passes.
_STDERR_FILTER = r"""
import os, re, select, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
pid, nproc, timeout = map(int, sys.argv[1:4])
coordinator_flag, num_flag, pid_flag = sys.argv[4:7]
out, met, held, fatal, since = 1, False, b"", False, None
burst = re.compile(rb"^[IWEF]\d{4} [\d:. ]+\d+ (coordination_service|preemption_sync_manager|"
                   rb"client\.h)", re.M)
MET = b"\0ladder-jax-met\0"
def write(data):
    while data:
        data = data[os.write(out, data):]
def finish():
    text = held.decode("utf-8", "replace")
    tasks = re.search(r"stopped sending heartbeats\):\s*([\d\s,]+)", text)
    peers = sorted({int(x) for x in re.findall(r"\d+", tasks.group(1))} - {pid}) if tasks else []
    if not met:
        why = (f"the coordinator refused this process: is a {pid_flag} given twice, or another "
               f"job using this {coordinator_flag}?")
        line = (f"process {pid} of {nproc}: the job's processes did not all meet ({why}): start "
                f"every process with the same {coordinator_flag} and {num_flag} and its own "
                f"{pid_flag} from 0 to {nproc - 1}")
    else:
        who = (f"process(es) {', '.join(map(str, peers))} stopped answering" if peers else
               "lost process 0, the coordinator" if pid else "the job's coordination failed")
        line = (f"process {pid} of {nproc}: {who} (died, killed or stopped): see its output, "
                f"then start every process of the job again (training resumes from its last "
                f"checkpoint; LADDER_PEER_TIMEOUT={timeout} s is the wait)")
    write(f"error: {line}\n".encode())
while True:
    wait = None if since is None or fatal else max(0.0, since + 2 - time.monotonic())
    if not select.select([0], [], [], wait)[0]:
        write(held)
        held, since = b"", None
        continue
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break
    if MET in chunk:
        met, chunk = True, chunk.replace(MET, b"")
    if fatal:
        held += chunk
        continue
    if since is None:
        found = burst.search(chunk)
        if found is None:
            write(chunk)
            continue
        write(chunk[:found.start()])
        chunk, since = chunk[found.start():], time.monotonic()
    held += chunk
    fatal = b"Terminating process because the JAX distributed service" in held
if fatal:
    finish()
else:
    write(held)
"""


def _filter_stderr(pid: int, nproc: int, timeout: int, flags: tuple = None) -> None:
    """Routes this process's native stderr through `_STDERR_FILTER` (a child process that
    outlives it); `_met_stderr()` tells it the job's processes have met."""
    import ctypes
    import signal
    import subprocess

    sys.stderr.flush()
    read, write = os.pipe()
    real = os.dup(2)
    _met_stderr.child = subprocess.Popen(  # a session of its own: Ctrl-C is for this process
        [sys.executable, "-c", _STDERR_FILTER, str(pid), str(nproc), str(timeout)]
        + list(flags or CLI_FLAGS),
        stdin=read,
        stdout=real,
        close_fds=True,
        start_new_session=True,
    )
    for fd in (read, real):
        os.close(fd)
    os.dup2(write, 2)
    os.close(write)
    _met_stderr.filtered = True
    try:  # jaxlib's abort after its stack: exit code 6 (SIGABRT's number), without a core dump
        libc = ctypes.CDLL(None)
        libc.signal(int(signal.SIGABRT), ctypes.cast(libc._exit, ctypes.c_void_p))
    except (OSError, AttributeError):
        pass


def _met_stderr() -> None:
    if getattr(_met_stderr, "filtered", False):
        sys.stderr.flush()
        os.write(2, b"\0ladder-jax-met\0")


def has_nvidia_gpu() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def cpu_only() -> bool:
    """Whether jax will run on the CPU here: JAX_PLATFORMS=cpu, or unset on a host without an
    NVIDIA device (what `setup` picks)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return platforms == "cpu" or (not platforms and not has_nvidia_gpu())


# jax logs this record (with the plugin's traceback) when its CUDA plugin is installed but
# finds no CUDA: on a host without an NVIDIA device that is expected, and it runs on the CPU
_CUDA_PLUGIN_LOGGER = "jax._src.xla_bridge"
_CUDA_PLUGIN_FAILED = "Jax plugin configuration error: Exception when calling %s.initialize()"


class _MissingCuda(logging.Filter):
    """Drops jax's "Exception when calling jax_plugins.xla_cuda*.initialize()" record, and
    nothing else: other plugins, other messages and other loggers pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            record.name == _CUDA_PLUGIN_LOGGER
            and record.msg == _CUDA_PLUGIN_FAILED
            and len(args) == 1
            and str(args[0]).startswith("jax_plugins.xla_cuda")
        )


_HUSH = _MissingCuda()


def hush_missing_cuda() -> bool:
    """On a host without an NVIDIA device, filters out the one loud log record jax writes when
    its CUDA plugin is installed but cannot load CUDA (jax then runs on the CPU, as it should);
    with a GPU present the record stays, since there it is news. True where the filter is on.
    Idempotent; `import ladder_jax` calls it."""
    logger = logging.getLogger(_CUDA_PLUGIN_LOGGER)
    if has_nvidia_gpu():
        return False
    if _HUSH not in logger.filters:
        logger.addFilter(_HUSH)
    return True


def setup(
    *,
    cpu_devices: int | None = None,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    flags: tuple[str, str, str] | None = None,
) -> None:
    """Platform, fake CPU devices and `jax.distributed`, in that order (module docstring).
    `flags`: how the caller's user sets the coordinator, the number of processes and the
    process id, for the messages (default `CLI_FLAGS`; the trainer's config keys for it)."""
    flags = tuple(flags or CLI_FLAGS)
    import jax

    from ladder_jax.config import ConfigError

    if not os.environ.get("JAX_PLATFORMS") and not has_nvidia_gpu():
        jax.config.update("jax_platforms", "cpu")
    cpu = (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "") == "cpu"
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if cpu and cpu_devices and not forced:
        try:
            jax.config.update("jax_num_cpu_devices", int(cpu_devices))
        except RuntimeError:  # the backend is up already (an in-process caller): keep it
            pass
    addr = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    nproc = num_processes or _env_int("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
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
            drop_stdout_lines(_GLOO)
        _initialize(jax, addr, nproc, pid, flags)
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        if cpu:
            drop_stdout_lines(_GLOO)
        jax.distributed.initialize()  # SLURM: everything comes from its environment
        from jax._src import distributed

        g = distributed.global_state
        _watch_peers(g.client, g.process_id, g.num_processes, peer_timeout())
    if cpu:
        keep_freed_memory()
    with quiet():
        jax.devices()
    if addr or (nproc or 1) > 1:  # a job of another size can still meet: say so
        agree({"num_processes": nproc}, flags[1])


def peer_timeout() -> int:
    """Seconds a process waits for its peers (LADDER_PEER_TIMEOUT, default 60)."""
    from ladder_jax.config import ConfigError

    t = _env_int("LADDER_PEER_TIMEOUT")
    if t is not None and t <= 0:
        raise ConfigError(f"LADDER_PEER_TIMEOUT={t} must be a positive number of seconds")
    return t or 60


def _initialize(jax, addr: str, nproc: int, pid: int, flags: tuple = CLI_FLAGS) -> None:
    """jax.distributed.initialize with bounded waits; one ConfigError when the job's other
    processes do not all connect in time (none started, a wrong --num-processes, a process id
    given twice). Then `_watch_peers` runs until the process ends."""
    from ladder_jax.config import ConfigError

    t = peer_timeout()

    def message(why: str) -> str:
        return (
            f"process {pid} of {nproc}: the job's processes did not all meet at the "
            f"coordinator {addr} within {t} s ({why}): start every process with the same "
            f"{flags[0]} and {flags[1]} and its own {flags[2]} from 0 to "
            f"{nproc - 1} (LADDER_PEER_TIMEOUT sets the wait)"
        )

    def give_up():  # jaxlib's own timeout ends the process from C++ (a stack, SIGABRT)
        print(f"error: {message('none came, or too few')}", file=sys.stderr, flush=True)
        os._exit(2)

    if pid == 0:  # gRPC shares a port between servers: a second process 0 would go unseen
        _check_port_free(addr, message)
    _filter_stderr(pid, nproc, t, flags)
    timer = threading.Timer(t, give_up)
    timer.daemon = True
    timer.start()
    try:  # jaxlib's heartbeat ends a process with a C++ stack: later than the watch below
        jax.distributed.initialize(
            addr, nproc, pid, initialization_timeout=t + 30, heartbeat_timeout_seconds=2 * t + 30
        )
    except Exception as e:  # noqa: BLE001 (jaxlib's errors have no public classes)
        raise ConfigError(message(_first_line(e))) from None
    finally:
        timer.cancel()
    _met_stderr()
    from jax._src import distributed

    _watch_peers(distributed.global_state.client, pid, nproc, t)


def _check_port_free(addr: str, message) -> None:
    """A ConfigError (through `message`) when the coordinator's port is taken on this host."""
    import socket

    from ladder_jax.config import ConfigError

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


_PEERS = {"pid": 0, "nproc": 1, "timeout": 60}
_LAST_WORDS = threading.Lock()  # one line from whichever thread ends the process first
_ALIVE = "ladder_jax_alive/"  # the coordination service's keys of the watch below


def _watch_peers(client, pid: int, nproc: int, timeout: int) -> None:
    """Every process writes a counter to the coordination service's key-value store about once
    a second and reads everyone's: a peer whose counter has not moved for `timeout` seconds
    (dead, killed, stopped), or a coordinator this process cannot reach that long, ends this
    process with one line naming it and exit code 1, whatever the main thread is blocked in
    (a collective, a checkpoint barrier). It beats until the process really ends (a process
    done early waits for its peers in jax's shutdown barrier, alive)."""
    import atexit

    _PEERS.update(pid=pid, nproc=nproc, timeout=timeout)
    beat = min(1.0, timeout / 10)
    state = {"ok": time.monotonic(), "seen": {}, "exiting": False}

    def lost(who: str):
        _LAST_WORDS.acquire()
        print(
            f"error: process {pid} of {nproc}: {who} (died, killed or stopped): see its "
            f"output, then start every process of the job again (training resumes from its "
            f"last checkpoint; LADDER_PEER_TIMEOUT={timeout} s is the wait)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def beats():
        count = 0
        while not state.get("stop"):
            count += 1
            try:
                client.key_value_set(f"{_ALIVE}{pid}", str(count), allow_overwrite=True)
                values = dict(client.key_value_dir_get(_ALIVE))
            except Exception:  # noqa: BLE001 (jaxlib's errors have no public classes)
                if state["exiting"]:  # jax's client is shut down: nothing more to watch
                    state["ok"] = None
                    return
                values = None
            now = time.monotonic()
            if values is not None:
                state["ok"] = now
                for key, value in values.items():
                    peer = int(key.rsplit("/", 1)[-1])
                    if state["seen"].get(peer, (None,))[0] != value:
                        state["seen"][peer] = (value, now)
            time.sleep(beat)
        state["ok"] = None

    def check():
        start = time.monotonic()
        while state["ok"] is not None:
            time.sleep(beat)
            now = time.monotonic()
            if state["ok"] is not None and now - state["ok"] > timeout:
                lost(f"no answer from the coordinator, process 0, for {timeout} s")
            stale = [
                p
                for p in range(nproc)
                if p != pid and now - state["seen"].get(p, (None, start))[1] > timeout
            ]
            if stale:
                lost(f"process(es) {', '.join(map(str, stale))} stopped answering for {timeout} s")

    threads = [
        threading.Thread(target=t, name=f"peer-watch-{t.__name__}", daemon=True)
        for t in (beats, check)
    ]

    # jax's own exit work (backends, then the shutdown barrier) runs inside this handler, so
    # the beats go on through the barrier and are then stopped and joined: a daemon thread
    # still inside the coordination client when the interpreter finalizes aborts the process.
    from jax._src import api

    def exiting():
        state["exiting"] = True
        try:
            if jax_exit is not None:
                jax_exit()
        finally:
            state["stop"] = True
            threads[0].join(timeout=max(5.0, 3 * beat))

    jax_exit = getattr(api, "clean_up", None)
    if jax_exit is not None:
        atexit.unregister(jax_exit)
    atexit.register(exiting)
    for thread in threads:
        thread.start()


def collective_failed(error: BaseException) -> None:
    """In a job of several processes (nothing otherwise), ends the process after an error from
    jax (a collective whose peer died: Gloo's connection reset): the watch's line when a peer
    is gone (within LADDER_PEER_TIMEOUT), else the error's first line; exit code 1 either way,
    without jax's shutdown barrier (which would abort with a C++ stack).

        except jax.errors.JaxRuntimeError as e:
            runtime.collective_failed(e)
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
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from ladder_jax.config import ConfigError

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
    import select
    import signal

    from ladder_jax.config import ConfigError

    grace = _env_int("LADDER_STOP_GRACE")
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


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_KEPT = {"done": None}


def setup_host(cpu_devices: int = 8) -> None:
    """For notebooks and scripts, before any jax work: on a host with no NVIDIA device use the
    CPU, split into `cpu_devices` fake devices so that tensor parallelism runs for real, only
    slower (`setup`, which the command-line tools call)."""
    setup(cpu_devices=cpu_devices)


def keep_freed_memory() -> bool:
    """Tells glibc's allocator to keep freed memory for reuse instead of returning it to the
    kernel: one arena for every thread (XLA's worker threads allocate the temporaries; a
    thread's own arena can only serve a block of that size by mapping it fresh), blocks from
    the heap rather than their own mappings (which `free` unmaps), and no trimming of the
    heap's free top below 2 GiB. The process then holds its peak memory (which it needed
    anyway) instead of faulting it in again on every program run, plus what fragmentation
    leaves between freed blocks (docs/results.md). Takes effect only before the backend's
    threads start (`setup` calls it first); True where it was applied (Linux with glibc,
    LADDER_JAX_HOST_MALLOC not `default`), once per process."""
    if _KEPT["done"] is not None:
        return _KEPT["done"]
    _KEPT["done"] = False
    if os.environ.get("LADDER_JAX_HOST_MALLOC", "").strip().lower() == "default":
        return False
    import ctypes
    import platform

    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (
            libc.mallopt(_M_ARENA_MAX, 1) == 1
            and libc.mallopt(_M_MMAP_MAX, 0) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
        )
    except (OSError, AttributeError):
        return False
    _KEPT["done"] = bool(ok)
    return _KEPT["done"]


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def add_arguments(parser, *, cpu_devices_help: str) -> None:
    """The start-up flags of the command-line tools (argparse)."""
    g = parser.add_argument_group("processes and devices")
    g.add_argument("--cpu-devices", type=int, default=None, help=cpu_devices_help)
    g.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of process 0, for several processes (or JAX_COORDINATOR_ADDRESS)",
    )
    g.add_argument(
        "--num-processes", type=int, default=None, help="processes in all (or JAX_NUM_PROCESSES)"
    )
    g.add_argument(
        "--process-id", type=int, default=None, help="this process, 0..N-1 (or JAX_PROCESS_ID)"
    )


def _env_int(name):
    from ladder_jax.config import ConfigError

    v = os.environ.get(name)
    try:
        return int(v) if v else None
    except ValueError:
        raise ConfigError(f"{name}={v!r} must be an integer") from None


def available_memory() -> int | None:
    """Bytes of host memory this process can still allocate: the kernel's MemAvailable, capped
    by the cgroup's limit (containers); None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def peak_memory(devices=()) -> dict:
    """This process's memory high-water marks, in bytes: `host` the peak resident set size
    (getrusage; None where it cannot be read) and `device` the largest `peak_bytes_in_use`
    jax's allocator reports over `devices` (None where it keeps no pool statistics, as on
    XLA:CPU, whose devices are host memory and so inside `host`)."""
    host = None
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        host = int(kb) * (1 if sys.platform == "darwin" else 1024) or None
    except (ImportError, OSError, ValueError):
        pass
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # backends without the call raise various errors
            stats = {}
        if stats.get("peak_bytes_in_use"):
            peaks.append(int(stats["peak_bytes_in_use"]))
    return {"host": host, "device": max(peaks) if peaks else None}


def check_host_memory(need: int, what: str, fix: str) -> None:
    """On a CPU backend (where the devices are host memory), a one-line ConfigError when `need`
    bytes will not fit in `available_memory()`: said before allocating, not after minutes."""
    import jax

    from ladder_jax.config import ConfigError

    avail = available_memory()
    if jax.default_backend() != "cpu" or avail is None or need <= avail:
        return
    raise ConfigError(
        f"{what} needs at least {need / 1e9:.1f} GB of host memory but "
        f"{avail / 1e9:.1f} GB is available: {fix}"
    )
