"""Helpers shared by the test modules (`from tests.helpers import ...`). tests/conftest.py has
already made the 8 fake CPU devices when these are imported."""

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

import ladder_jax as lj
from ladder_jax.loading import CHECKSUMS
from ladder_jax.train import step

TINY = lj.ModelConfig.from_preset("tiny")
SCHEMES = {  # every valid scheme, hybrid included
    "standard": dict(residual="standard"),
    "parallel": dict(residual="parallel"),
    "ladder": dict(residual="ladder"),
    "hybrid": dict(residual="ladder", ladder_layers=2),
}


def mesh(tp, data=1):
    """A data x tp mesh over the first tp * data fake devices."""
    return lj.make_mesh(tp=tp, data=data, devices=jax.devices()[: tp * data])


def tiny_model(tp=1, seed=0, **changes):
    """The tiny preset with `changes`, on a tp mesh."""
    return lj.Transformer(dataclasses.replace(TINY, **changes), mesh=mesh(tp), rngs=nnx.Rngs(seed))


@nnx.jit
def logits(model, tokens):
    return model(tokens)


def one_line(capsys, rc, code=2, *, quiet=False) -> str:
    """The single `error: ...` line of a command that must have exited with `code`; `quiet`:
    and printed nothing on stdout."""
    out, err = capsys.readouterr()
    assert rc == code, (rc, out, err)
    assert "Traceback" not in out + err
    assert not (quiet and out), out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def exit_code(main, argv) -> int:
    """The exit code of a command line's `main(argv)` run in-process, whether it returns it
    (ours) or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def cli_error(capsys, main, argv, code=2) -> str:
    """The single `error: ...` line of `main(argv)`, which must refuse with `code` and print
    nothing on stdout.

        assert "unknown preset" in cli_error(capsys, predict_cli.main, ["--preset", "x"])
    """
    return one_line(capsys, exit_code(main, argv), code, quiet=True)


def run_module(name: str, *args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """`python -m ladder_jax.<name> ARGS` run to its end on CPU, its output captured as text;
    `env` is added to this process's environment.

        r = run_module("decode", "--preset", "x"); assert r.returncode == 2
    """
    return subprocess.run(
        [sys.executable, "-m", f"ladder_jax.{name}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )


def train_process(*args, env=None, **kw) -> subprocess.Popen:
    """`python -m ladder_jax.train ARGS` started on CPU (stdout and stderr piped, as text);
    `env` replaces this process's environment.

        proc = train_process(*SMALL, "steps=300", f"run_dir={tmp_path}", "name=cut")"""
    return subprocess.Popen(
        [sys.executable, "-m", "ladder_jax.train", *args],
        env={**(os.environ if env is None else env), "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def benchmark(name: str):
    """benchmarks/<name>.py imported as a module (benchmarks/ is not a package), for its `main`.

    cli = benchmark("adaptation")
    """
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_cli", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flags(**values) -> list[str]:
    """Command-line words of keyword flags; a list or tuple gives a flag several values.

    flags(prompt_len=128, link=["nvlink", "pcie"])  # --prompt-len 128 --link nvlink pcie
    """
    words = []
    for name, v in values.items():
        words.append("--" + name.replace("_", "-"))
        words += [str(x) for x in v] if isinstance(v, (list, tuple)) else [str(v)]
    return words


def predict_json(capsys, argv) -> tuple[list[dict], str]:
    """The rows and stderr of `python -m ladder_jax.predict ARGV --json` run in-process (it
    must succeed)."""
    from ladder_jax.cli import predict as predict_cli

    assert predict_cli.main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    return [json.loads(line) for line in out.splitlines()], err


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE_KEY = "test-key"  # the API key of the servers tests start
SERVE_MAX_LEN = 96  # their positions per request


def start_server(tmp_path, name, *args, env=None):
    """`python -m ladder_jax.serve` on the tiny ladder preset with `args`, its output in
    tmp_path/name.log (`proc.log`)."""
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ladder_jax.serve",
            "--preset",
            "tiny",
            "--residual",
            "ladder",
            "--max-len",
            str(SERVE_MAX_LEN),
            "--no-warmup",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **(env or {})},
    )
    proc.log = tmp_path / f"{name}.log"
    return proc


def wait_healthy(proc, port, timeout=240):
    """Returns once the server's /health says ok; AssertionError with its log if it exits or
    is not healthy within `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{proc.log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"server not healthy in {timeout} s:\n{proc.log.read_text()}")


def stop_server(proc, timeout=60):
    """SIGTERM (then kill after `timeout` seconds); the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def openai_client(server, timeout=120, **kw):
    """The `openai` client of a server `running_server` started (its port, SERVE_KEY), which
    never retries (a test sees the first answer)."""
    import openai

    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1",
        api_key=SERVE_KEY,
        max_retries=0,
        timeout=timeout,
        **kw,
    )


@contextlib.contextmanager
def running_server(tmp_path, *args, env=None):
    """A healthy server on a free loopback port (`proc.port`) with the API key SERVE_KEY,
    stopped on exit: a module fixture's body."""
    port = free_port()
    proc = start_server(
        tmp_path,
        "server",
        "--port",
        str(port),
        *args,
        env={"LADDER_API_KEY": SERVE_KEY, **(env or {})},
    )
    try:
        wait_healthy(proc, port)
        proc.port = port
        yield proc
    finally:
        stop_server(proc)


def loss_and_grads(config, tp, data, fsdp=False, T=32):
    """Loss and gradients (host arrays) of the tiny-shaped `config` at seed 0 on a data x tp
    mesh, from `step.loss_and_grads` on a fixed batch."""
    m = mesh(tp, data)  # fsdp: weights stored split over data too, as mesh.fsdp=true does
    graphdef, params = nnx.split(lj.Transformer(config, mesh=m, rngs=nnx.Rngs(0), fsdp=fsdp))
    tokens = jax.random.randint(jax.random.key(3), (4, T + 1), 0, config.vocab_size)
    fn = jax.jit(lambda p, t: step.loss_and_grads(graphdef, p, t[:, :-1], t[:, 1:]))
    loss, grads = fn(params, tokens)
    return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def committed(run, step) -> bool:
    """Checkpoint `step` of `run` is complete: orbax renamed it into place and the trainer then
    recorded its checksums (the trainer's `Checkpointer` writes them once a save is finalized)."""
    return (run / "checkpoints" / str(step) / CHECKSUMS).is_file()


def last_step(run) -> int:
    """The last step `run`'s metrics record (0 before any); a line being written is skipped."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return max(steps)


def shrink(nb, cell: int, **values):
    """`nb` with each `name=VALUE` of code cell `cell` (a keyword or an assignment) set to the
    source text `values[name]`: the tests run a notebook on smaller settings than it is committed
    with. AssertionError if a name is not written exactly once in that cell.

        shrink(nb, 6, steps="8")  # `steps=80` -> `steps=8`
    """
    src = nb.cells[cell].source
    for name, value in values.items():
        pattern = rf"\b({re.escape(name)}\s*=\s*)([^,)\n]+)"
        assert len(re.findall(pattern, src)) == 1, (name, src)
        src = re.sub(pattern, lambda m: m.group(1) + value, src)
    nb.cells[cell].source = src
    return nb


def largest_data_file(step_dir, item: str) -> str:
    """The largest of orbax's data files (under .../d/) of `item` (params, opt_state) in a
    checkpoint step directory: the one a damage test truncates or corrupts."""
    files = [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(step_dir, item))
        for f in fs
        if f"{os.sep}d{os.sep}" in os.path.join(d, f)
    ]
    return max(files, key=os.path.getsize)


def flip_byte(file) -> None:
    """Corrupt `file` in place: one bit of its middle byte flipped."""
    with open(file, "r+b") as f:
        raw = bytearray(f.read())
        raw[len(raw) // 2] ^= 0x10
        f.seek(0)
        f.write(bytes(raw))
