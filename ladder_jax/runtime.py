"""Process start-up, the same for every command-line tool, before jax touches a backend: the
platform (fake CPU devices where no NVIDIA device is), the host allocator, the multi-process
join, and `quiet()` / `hush_missing_cuda()` for the CUDA plugin's start-up noise. Importing it
changes nothing; it imports jax only inside its functions.

    runtime.setup(cpu_devices=2)      # or coordinator=, num_processes=, process_id="""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import platform
import re
import resource
import sys
import tempfile
import threading

_NOISE = re.compile(
    r"absl::InitializeLog\(\) is called|cudart_stub\.cc.*cuda drivers"
    r"|Missing deviceless CUB scratch size data"
    r"|To avoid this, compile with a GPU present"
)
_QUIET = {"depth": 0, "saved": None, "tmp": None}
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
    """Platform, fake CPU devices and the job's processes (`processes.start`), in that order.
    `flags`: how the caller's user sets the coordinator, the number of processes and the
    process id, for the messages (default `processes.CLI_FLAGS`; the trainer's config keys)."""
    import jax

    from ladder_jax import processes

    if not os.environ.get("JAX_PLATFORMS") and not has_nvidia_gpu():
        jax.config.update("jax_platforms", "cpu")
    cpu = (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "") == "cpu"
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if cpu and cpu_devices and not forced:
        try:
            jax.config.update("jax_num_cpu_devices", int(cpu_devices))
        except RuntimeError:  # the backend is up already (an in-process caller): keep it
            pass
    nproc = processes.start(
        coordinator=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        cpu=cpu,
        flags=flags,
    )
    if cpu:
        keep_freed_memory()
    with quiet():
        jax.devices()
    if nproc is not None:  # a job of another size can still meet: say so
        processes.agree({"num_processes": nproc}, (flags or processes.CLI_FLAGS)[1])


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
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        host = int(kb) * (1 if sys.platform == "darwin" else 1024) or None
    except (OSError, ValueError):
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
