"""Runs that cannot be mixed, damaged or lost: one writer per run directory (the lock), damaged
checkpoints never trusted nor deleted, a failed save stops the run, a resume that only reads
writes nothing, a resume on another process count. Each case goes through the command line
(or the API) where it was found; one trained run (checkpoints at steps 2 and 4) is shared."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ladder_jax import loading, train_config
from ladder_jax.cli import train as train_cli
from ladder_jax.loading import DamagedCheckpoint
from ladder_jax.train import trainer
from ladder_jax.train.checkpoint import Checkpointer
from ladder_jax.train.lock import RunBusy, RunLock
from ladder_jax.train.step import TrainState
from tests.helpers import (
    committed,
    flip_byte,
    free_port,
    largest_data_file,
    last_step,
    one_line,
    train_process,
)

SMALL = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.batch_size=8",
    "eval_batches=2",
    "progress=none",
    "log_every=1000",
    "mesh.data=1",
    "eval_every=0",
    "ckpt_every=2",
    "tensorboard=false",
]


def snapshot(path):
    """{relative file: bytes} of a directory."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), path)] = fh.read()
    return out


def rows(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """runs/run: 4 steps, checkpoints at 2 and 4 (each test copies it)."""
    root = tmp_path_factory.mktemp("trained")
    assert train_cli.main(SMALL + ["steps=4", f"run_dir={root}", "name=run"]) == 0
    return root / "run"


def copy_run(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture(scope="module")
def target(trained):
    """A Trainer of the same config: the restore targets (its state and data iterator)."""
    return trainer.Trainer(
        train_config.load_config(SMALL + ["steps=4", f"run_dir={trained.parent}", "name=unused"])
    )


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: never trusted, never deleted.


DAMAGE = {  # name: (damage to checkpoints/<step>, what the skip says)
    "manifest_removed": (
        lambda c: os.remove(c / "params" / "manifest.ocdbt"),
        "params/manifest.ocdbt is missing",
    ),
    "data_truncated": (
        lambda c: os.truncate(
            largest_data_file(c, "params"), os.path.getsize(largest_data_file(c, "params")) // 2
        ),
        "(truncated or overwritten)",
    ),
    "bit_flipped": (lambda c: flip_byte(largest_data_file(c, "opt_state")), "is corrupt"),
    "metadata_removed": (lambda c: os.remove(c / "meta" / "metadata"), "no meta/metadata"),
    "metadata_garbled": (
        lambda c: (c / "meta" / "metadata").write_text('{"step": 4, "con'),
        "meta/metadata is unreadable",
    ),
    "iterator_removed": (
        lambda c: os.remove(c / "data" / "process_0-of-1.json"),
        "data/process_0-of-1.json is missing",
    ),
    "checksums_garbled": (
        lambda c: (c / loading.CHECKSUMS).write_text("[1"),
        "checksums.json is unreadable",
    ),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_checkpoint_is_refused_and_the_older_one_restores(trained, target, tmp_path, name):
    run = copy_run(trained, tmp_path)
    damage, says = DAMAGE[name]
    damage(run / "checkpoints" / "4")
    before = snapshot(run)
    ckpt = Checkpointer(str(run / "checkpoints"))
    try:
        with pytest.raises(DamagedCheckpoint) as e:
            ckpt.restore(4, target.state, target.data_iter)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
        state, meta = ckpt.restore(2, target.state, target.data_iter)
        assert isinstance(state, TrainState) and state.step == 2 and meta["step"] == 2
    finally:
        ckpt.close()
    assert snapshot(run) == before  # nothing deleted, nothing written


def test_stray_empty_checkpoint_is_skipped_and_a_read_only_resume_writes_nothing(
    trained, tmp_path, capsys
):
    run = copy_run(trained, tmp_path)
    os.makedirs(run / "checkpoints" / "99")
    before = snapshot(run)
    assert train_cli.main(SMALL + ["steps=4", f"run_dir={tmp_path}", "name=run"]) == 0
    out, err = capsys.readouterr()
    assert "skipped damaged checkpoint" in out and "/99: no meta/metadata" in out, out
    assert "resumed from" in out and "/4 " in out and "nothing to do" in out
    assert "Traceback" not in err
    assert snapshot(run) == before and os.path.isdir(run / "checkpoints" / "99")


@pytest.mark.parametrize("extra", [[], ["mesh.tp=2", "mesh.data=2"]])
def test_nothing_to_do_changes_nothing(trained, tmp_path, capsys, extra):
    run = copy_run(trained, tmp_path)
    before = snapshot(run)
    assert (
        train_cli.main(
            SMALL + ["steps=3", f"run_dir={tmp_path}", "name=run", "tensorboard=true", *extra]
        )
        == 0
    )
    assert "nothing to do" in capsys.readouterr().out
    assert snapshot(run) == before  # config.yaml not rewritten, no TensorBoard file


def test_no_checkpoint_verifies_is_one_line_and_changes_nothing(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    flip_byte(largest_data_file(run / "checkpoints" / "4", "params"))
    os.remove(run / "checkpoints" / "2" / "meta" / "metadata")
    before = snapshot(run)
    line = one_line(capsys, train_cli.main(SMALL + ["steps=6", f"run_dir={tmp_path}", "name=run"]))
    assert "no checkpoint in" in line and "4: " in line and "2: no meta/metadata" in line
    assert "new name=" in line and "move the damaged ones" in line, line
    assert snapshot(run) == before


def test_resume_past_a_damaged_checkpoint_is_bit_exact_and_keeps_it(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    flip_byte(largest_data_file(run / "checkpoints" / "4", "opt_state"))
    damaged = snapshot(run / "checkpoints" / "4")
    assert train_cli.main(SMALL + ["steps=4", f"run_dir={tmp_path}", "name=run"]) == 0
    out = capsys.readouterr().out
    assert "skipped damaged checkpoint" in out and "resumed from" in out and "/2 " in out, out
    assert snapshot(run / "checkpoints" / "4.damaged") == damaged  # kept, byte for byte
    # steps 3 and 4 again, from checkpoint 2: the losses of the uninterrupted run, bit for bit
    assert [r["loss"] for r in rows(run)] == [r["loss"] for r in rows(trained)]
    assert [r["batch_crc"] for r in rows(run)] == [r["batch_crc"] for r in rows(trained)]


# ---------------------------------------------------------------------------------------------
# A failed save stops the run.


def test_disk_full_during_an_async_save_stops_with_one_line(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    # files may not grow past 64 KiB (ulimit -f): the next checkpoint's cannot be written
    p = subprocess.Popen(
        [
            "bash",
            "-c",
            'ulimit -f 64 && exec "$@"',
            "bash",
            sys.executable,
            "-m",
            "ladder_jax.train",
            *SMALL,
            "steps=12",
            f"run_dir={tmp_path}",
            "name=run",
        ],
        # the limit holds for every file: the session's XLA compilation cache stays out of it
        env={
            **{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
            "JAX_PLATFORMS": "cpu",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 1, (out, err)
    assert "Traceback" not in out + err, err
    ours = [ln for ln in err.splitlines() if ln.strip() and "cuda" not in ln and "absl" not in ln]
    assert len(ours) == 1 and ours[0].startswith("error: could not write checkpoint 6 in "), err
    assert "(File too large): the last complete checkpoint, step 4, is intact" in ours[0]
    assert "run the same command again to resume" in ours[0]
    steps = [r["step"] for r in rows(run)]
    assert 6 <= max(steps) < 12, steps  # it stopped, it did not train on
    ckpt = Checkpointer(str(run / "checkpoints"))
    try:
        assert ckpt.latest_step() == 4
        assert loading.verify_checksums(str(run / "checkpoints" / "4"))
    finally:
        ckpt.close()


# ---------------------------------------------------------------------------------------------
# One writer per run directory.


def test_lock_names_its_holder_and_a_dead_holder_is_stale(tmp_path):
    run = tmp_path / "r"
    with RunLock(str(run)) as held:
        with pytest.raises(RunBusy, match=rf"pid {os.getpid()} on host \S+, started"):
            RunLock(str(run)).acquire()
        assert held.stale is None
    assert not run.exists()  # created for the lock, nothing else written: removed again
    # a lock file left by a process that no longer runs (kill -9): taken over
    run.mkdir()
    (run / ".lock").write_text(json.dumps({"host": "h", "pid": 999999, "started": "x"}))
    with RunLock(str(run)) as lock:
        assert lock.stale == {"host": "h", "pid": 999999, "started": "x"}
    assert os.listdir(run) == []


def test_a_run_directory_made_by_another_trainer_meanwhile_is_taken_not_a_crash(
    tmp_path, monkeypatch
):
    """Two trainers started at once both find the run directory missing; the one whose mkdir
    comes second gets the lock (or RunBusy), never FileExistsError, and never removes the
    directory the other made."""
    run, parent = tmp_path / "runs" / "new", tmp_path / "runs"
    real_mkdir = os.mkdir

    def racing_mkdir(path, *args, **kw):
        if os.fspath(path) == str(run):
            real_mkdir(path)  # the other trainer, a moment earlier
        return real_mkdir(path, *args, **kw)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    with RunLock(str(run)) as lock:
        assert lock.created == [str(parent)]  # its own mkdir only
        (run / "metrics.jsonl").write_text("")  # the other trainer's output
    assert run.is_dir() and os.listdir(run) == ["metrics.jsonl"]


@pytest.mark.parametrize("before", ["", "dead holder's"])
def test_a_refused_trainer_names_the_holder_that_has_just_locked(tmp_path, before):
    """The holder locks first and writes its name a moment later; a trainer refused in that
    moment reads an empty file or the name of the dead process before it: it waits for the
    current name rather than saying "another process" or naming the dead one."""
    import socket
    import threading

    run = tmp_path / "r"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    if before:
        (run / ".lock").write_text(
            json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "then"})
        )
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)
    name = json.dumps({"host": "elsewhere", "pid": 4242, "started": "now"}).encode()
    timer = threading.Timer(0.3, lambda: (os.pwrite(fd, name, 0), os.ftruncate(fd, len(name))))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other trainer, not yet named
        timer.start()
        with pytest.raises(RunBusy, match=r"\(pid 4242 on host elsewhere, started now\)"):
            RunLock(str(run)).acquire()
    finally:
        timer.cancel()
        timer.join()
        os.close(fd)


def test_two_trainers_one_runs_and_kill_9_then_rerun_resumes_bit_exact(tmp_path, capsys):
    args = SMALL + ["steps=300", "ckpt_every=100", f"run_dir={tmp_path}", "name=both"]
    procs = [train_process(*args), train_process(*args)]
    run = tmp_path / "both"
    deadline, loser = time.time() + 900, None
    # the state the rerun needs: checkpoint 100 committed, and steps after it that it replays
    while not (loser is not None and committed(run, 100) and last_step(run) >= 120):
        assert time.time() < deadline, "no committed checkpoint 100 and step 120 in 900 s"
        done = [p for p in procs if p.poll() is not None]
        assert len(done) < 2, [p.communicate() for p in procs]
        if done and loser is None:
            loser = done[0]
        time.sleep(0.02)
    winner = procs[1 - procs.index(loser)]
    assert winner.poll() is None, winner.communicate()
    winner.send_signal(signal.SIGKILL)  # mid-run, after checkpoint 100
    winner.wait(timeout=60)
    out, err = loser.communicate()
    assert loser.returncode == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        f"error: {tmp_path / 'both'} is in use by another trainer (pid "
        f"{winner.pid} on host {os.uname().nodename}, started "
    ), line
    assert line.endswith("wait for it to finish, stop it, or give this run a new name="), line
    before = rows(tmp_path / "both")
    assert (tmp_path / "both" / ".lock").exists()  # stale: its holder is dead
    assert train_cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"taking over the lock of pid {winner.pid}" in out and "resumed from" in out
    after = rows(tmp_path / "both")
    assert [r["step"] for r in after] == list(range(1, 301))
    # the steps after checkpoint 100 that the killed run had taken, replayed bit for bit
    cut = {r["step"]: r for r in before if r["step"] > 100}
    assert len(cut) >= 20
    assert [after[s - 1]["loss"] for s in cut] == [r["loss"] for r in cut.values()]
    assert [after[s - 1]["batch_crc"] for s in cut] == [r["batch_crc"] for r in cut.values()]
    assert not (tmp_path / "both" / ".lock").exists()


# ---------------------------------------------------------------------------------------------
# Resume on another process count.


def test_resume_on_two_processes_reshards_the_data_iterator(trained, tmp_path):
    one = copy_run(trained, tmp_path / "one")
    two = copy_run(trained, tmp_path / "two")
    ref = trainer.run(
        train_config.load_config(SMALL + ["steps=6", f"run_dir={one.parent}", "name=run"])
    )["losses"]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        train_process(
            *SMALL,
            "steps=6",
            f"run_dir={two.parent}",
            "name=run",
            "mesh.cpu_devices=1",
            "mesh.data=2",
            f"dist.coordinator_address=127.0.0.1:{port}",
            "dist.num_processes=2",
            f"dist.process_id={i}",
            env=env,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "re-sharded onto 2 process(es)" in outs[0][0], outs[0][0]
    got = rows(two)
    assert [r["step"] for r in got] == list(range(1, 7))
    # the same records per step (the global batch's rows in another order): equal up to rounding
    np.testing.assert_allclose([r["loss"] for r in got[4:]], [ref[5], ref[6]], rtol=2e-5)


# ---------------------------------------------------------------------------------------------
# Typed state.


def test_init_state_returns_a_train_state_and_sets_nothing(target):
    graphdef = target.graphdef
    other, state = target.init_state(target.model_config)
    assert isinstance(state, TrainState) and state.step == 0
    assert target.graphdef is graphdef and other is not graphdef
