"""`ladder_jax.loading` and the commands built on it: a saved model loads back equal; a damaged
checkpoint is refused in one line naming the file by every loader (lj.load, decode, eval, serve);
`convert` and `eval --output` check their arguments before any work and write their results
whole or not at all (a full disk injected as the OSError it raises)."""

import gzip
import json
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors import SafetensorError

import ladder_jax as lj
from ladder_jax import atomic, loading, runtime
from ladder_jax.cli import convert
from ladder_jax.cli import decode as decode_cli
from ladder_jax.cli import eval as eval_cli
from ladder_jax.cli import serve as serve_cli
from ladder_jax.cli import train as train_cli
from ladder_jax.config import ConfigError
from ladder_jax.interop import hf
from ladder_jax.interop.tokenizer import ByteTokenizer
from tests.helpers import (
    TINY,
    flip_byte,
    free_port,
    largest_data_file,
    logits,
    one_line,
    run_module,
    tiny_model,
)

TOKENS = np.array([[1, 72, 101, 108, 108, 111, 32, 119]], np.int32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model written by `save_model` (what `convert` writes), and the model."""
    model = tiny_model(n_layers=2)
    path = tmp_path_factory.mktemp("saved") / "m"
    loading.save_model(model, str(path), tokenizer=ByteTokenizer(), source="nowhere")
    return path, model


def _copy(saved, tmp_path):
    return shutil.copytree(saved[0], tmp_path / "m")


def test_a_saved_model_loads_back_equal(saved):
    path, model = saved
    assert os.path.isfile(path / "checkpoints" / "0" / loading.CHECKSUMS)
    assert loading.verify_checksums(str(path / "checkpoints" / "0"))
    again, tokenizer = lj.load(str(path), tp=1)
    assert isinstance(tokenizer, ByteTokenizer) and again.config == model.config
    np.testing.assert_array_equal(
        np.asarray(logits(again, TOKENS)), np.asarray(logits(model, TOKENS))
    )
    assert not [f for f in os.listdir(path.parent) if f.startswith(".")]  # no partial sibling


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: one line naming the file, in every read-only path.


def _weights(m):
    """The largest weights file of checkpoint 0 (orbax's data under params/)."""
    return largest_data_file(m / "checkpoints" / "0", "params")


def _unrecorded(m):
    """Cut short with no checksums to tell: the restore itself must fail in one line."""
    os.remove(m / "checkpoints" / "0" / loading.CHECKSUMS)
    os.truncate(_weights(m), 0)


DAMAGE = {  # name: (damage to the model directory, what the line says)
    "truncated": (lambda m: os.truncate(_weights(m), os.path.getsize(_weights(m)) // 2), "bytes"),
    "emptied": (lambda m: os.truncate(_weights(m), 0), "has 0 bytes"),
    "corrupted": (lambda m: flip_byte(_weights(m)), "is corrupt"),
    "params_metadata_removed": (
        lambda m: os.remove(m / "checkpoints" / "0" / "params" / "_METADATA"),
        "params/_METADATA is missing",
    ),
    "meta_removed": (
        lambda m: os.remove(m / "checkpoints" / "0" / "meta" / "metadata"),
        "meta/metadata is missing",
    ),
    "unrecorded_truncation": (_unrecorded, "does not restore"),
}


def _damaged(saved, tmp_path, case):
    m = _copy(saved, tmp_path)
    damage, says = DAMAGE[case]
    named = os.path.relpath(_weights(m), m / "checkpoints" / "0")
    damage(m)
    if case in ("truncated", "emptied", "corrupted"):
        says = f"{named} {'is corrupt' if case == 'corrupted' else 'has'}"
    return m, says


def test_a_config_that_does_not_match_the_weights_is_not_called_quantized(saved, tmp_path):
    """Fewer layers in config.yaml than in the checkpoint: the extra norms' `scale` weights are
    not int8 scales (those sit beside a Linear's `weight`)."""
    m = _copy(saved, tmp_path)
    (m / "config.yaml").write_text("model:\n  preset: tiny\n  n_layers: 1\n")
    with pytest.raises(ConfigError, match="holds weights this model does not have") as e:
        lj.load(str(m), tp=1)
    assert "quantized" not in str(e.value)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_lj_load_refuses_a_damaged_checkpoint_in_one_line(saved, tmp_path, case):
    m, says = _damaged(saved, tmp_path, case)
    with pytest.raises(ConfigError) as e:
        lj.load(str(m), tp=1)
    assert says in str(e.value) and str(m) in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def _task(root):
    """A one-doc multiple-choice task in OLMES' layout: toy/rc_0shot."""
    path = root / "toy" / "rc_0shot"
    os.makedirs(path)
    (path / "config.json").write_text(
        json.dumps({"task_config": {"primary_metric": "acc_raw", "metric_kwargs": {}}})
    )
    with gzip.open(path / "requests.jsonl.gz", "wt") as f:
        for i, cont in enumerate((" yes", " no")):
            request = {"context": "Is it?", "continuation": cont}
            row = {"request_type": "loglikelihood", "doc": {}, "doc_id": 0, "idx": i}
            f.write(json.dumps({**row, "label": 0, "request": request}) + "\n")
    return str(root)


READ_ONLY_CASES = ["truncated", "corrupted", "meta_removed", "unrecorded_truncation"]


@pytest.mark.parametrize("case", READ_ONLY_CASES)
def test_decode_and_eval_refuse_a_damaged_checkpoint_in_one_line(saved, tmp_path, capsys, case):
    m, says = _damaged(saved, tmp_path, case)
    argv = ["--checkpoint", str(m), "--prompt", "Hi", "--tp", "1", "--max-new-tokens", "2"]
    assert says in one_line(capsys, decode_cli.main(argv))
    tasks = _task(tmp_path / "tasks")
    argv = ["--checkpoint", str(m), "--tasks", "toy", "--tasks-dir", tasks, "--tp", "1"]
    assert says in one_line(capsys, eval_cli.main(argv))


def test_serve_refuses_a_damaged_checkpoint_in_one_line(saved, tmp_path):
    m, says = _damaged(saved, tmp_path, "truncated")
    r = run_module(
        "serve", "--checkpoint", str(m), "--tp", "1", "--port", str(free_port()), timeout=240
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert [ln for ln in lines if ln.startswith("error: ")] == [lines[-1]] and says in lines[-1]


# ---------------------------------------------------------------------------------------------
# convert: arguments before devices; written whole or not at all.


def test_an_empty_out_or_output_is_refused(saved, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty path is the current directory to os.path
    line = one_line(capsys, convert.main(["--checkpoint", str(saved[0]), "--out", ""]))
    assert "--out '': give the directory" in line, line
    argv = ["--checkpoint", str(saved[0]), "--tasks", "toy", "--tasks-dir", _task(tmp_path)]
    line = one_line(capsys, eval_cli.main(argv + ["--output", ""]))
    assert "--output '': give a file" in line, line
    assert os.listdir(tmp_path) == ["toy"]


@pytest.mark.parametrize("tp", ["0", "-3", "100000"])
def test_convert_refuses_a_tp_that_cannot_exist_before_making_devices(
    saved, tmp_path, capsys, monkeypatch, tp
):
    monkeypatch.setattr(runtime, "setup", lambda **k: pytest.fail("devices were made"))
    out = tmp_path / "out"
    argv = ["--checkpoint", str(saved[0]), "--out", str(out), "--tp", tp]
    line = one_line(capsys, convert.main(argv))
    want = "at least 1" if int(tp) < 1 else f"at most {TINY.n_heads}"
    assert f"--tp {tp}: " in line and want in line and "between" not in line, line
    assert not out.exists()


def _full_disk(monkeypatch, where):
    """The next write of the weights fails as a full disk does, where each writer reports it."""
    if where == "orbax":  # tensorstore's error, as seen on a full tmpfs

        def save(self, *a, **k):
            raise ValueError(
                'RESOURCE_EXHAUSTED: Error writing "embed/0": No space left on device '
                "[os_error_code='28']"
            )

        monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    else:  # what safetensors raises

        def save_file(*a, **k):
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr(hf, "save_file", save_file)


@pytest.mark.parametrize("to_hf", [False, True])
def test_convert_onto_a_full_disk_leaves_nothing_and_the_rerun_works(
    saved, tmp_path, capsys, monkeypatch, to_hf
):
    out = tmp_path / "out"
    argv = ["--checkpoint", str(saved[0]), "--out", str(out)] + (["--to-hf"] if to_hf else [])
    with monkeypatch.context() as patch:
        _full_disk(patch, "safetensors" if to_hf else "orbax")
        line = one_line(capsys, convert.main(argv), code=1)
    assert "No space left on device" in line and "run the same command again" in line, line
    assert os.listdir(tmp_path) == []  # no --out, no temporary sibling
    assert convert.main(argv) == 0
    capsys.readouterr()
    model, _ = lj.load(str(out), tp=1)
    np.testing.assert_array_equal(
        np.asarray(logits(model, TOKENS)), np.asarray(logits(saved[1], TOKENS))
    )
    os.mkdir(tmp_path / "plain")  # what an ordinary mkdir / open give here
    (tmp_path / "plain" / "f").write_text("")
    file_mode = os.stat(tmp_path / "plain" / "f").st_mode & 0o777
    for d, dirs, files in os.walk(out):
        assert os.stat(d).st_mode & 0o777 == os.stat(tmp_path / "plain").st_mode & 0o777, d
        for f in files:  # model.safetensors (or the orbax files) as the rest
            assert os.stat(os.path.join(d, f)).st_mode & 0o777 == file_mode, f


def test_convert_interrupted_while_writing_leaves_nothing(saved, tmp_path, capsys, monkeypatch):
    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ocp.CheckpointManager, "save", interrupted)
    out = tmp_path / "out"
    assert convert.main(["--checkpoint", str(saved[0]), "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"stopped: nothing was written to --out {str(out)!r}", err
    assert os.listdir(tmp_path) == []


def test_save_hf_onto_a_full_disk_leaves_nothing(saved, tmp_path, monkeypatch):
    _full_disk(monkeypatch, "safetensors")
    with pytest.raises(OSError, match="No space left on device"):
        lj.save_hf(saved[1], tmp_path / "hf", tokenizer=ByteTokenizer())
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# eval --output: checked before the work; a finished result is never lost.


def test_eval_output_that_cannot_be_written_is_refused_before_loading(
    saved, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(eval_cli, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    tasks = _task(tmp_path / "tasks")
    argv = ["--checkpoint", str(saved[0]), "--tasks", "toy", "--tasks-dir", tasks]
    line = one_line(capsys, eval_cli.main(argv + ["--output", "/proc/self/results.jsonl"]))
    assert "--output /proc/self/results.jsonl: cannot write in /proc/self" in line, line
    line = one_line(capsys, eval_cli.main(argv + ["--tp", "0"]))
    assert "--tp 0: give the number of devices" in line, line
    line = one_line(capsys, eval_cli.main(argv + ["--tp", "100000"]))
    assert f"at most {TINY.n_heads}" in line, line


def test_eval_results_survive_a_failed_output_write(saved, tmp_path, capsys, monkeypatch):
    tasks = _task(tmp_path / "tasks")
    out = tmp_path / "results.jsonl"
    argv = ["--checkpoint", str(saved[0]), "--tasks", "toy", "--tasks-dir", tasks, "--tp", "1"]
    assert eval_cli.main(argv + ["--output", str(out)]) == 0
    want = [
        {k: v for k, v in json.loads(x).items() if k != "seconds"}
        for x in out.read_text().splitlines()
    ]
    capsys.readouterr()

    def full(path, text):
        raise OSError(28, os.strerror(28), path)

    monkeypatch.setattr(atomic, "write_text", full)
    rc = eval_cli.main(argv + ["--output", str(tmp_path / "again.jsonl")])
    captured = capsys.readouterr()
    assert rc == 1 and "toy" in captured.out, captured
    line = captured.err.strip().splitlines()[-1]  # after the note on idle devices
    assert line.startswith("error: ") and "Traceback" not in captured.err, captured.err
    assert "No space left on device" in line and "the results are in " in line, line
    rescue = line.split("the results are in ")[1].split(" instead")[0]
    try:
        got = [json.loads(x) for x in open(rescue).read().splitlines()]
        assert [{k: v for k, v in r.items() if k != "seconds"} for r in got] == want
    finally:
        os.remove(rescue)
    assert not (tmp_path / "again.jsonl").exists()


def test_decode_serve_and_train_refuse_a_tp_that_cannot_exist_before_making_devices(
    capsys, monkeypatch, tmp_path
):
    """The neighbours of convert's --tp: decode and serve (--tp), train (mesh.tp, and a
    mesh.data larger than the batch) say so before `runtime.setup` makes a device."""
    monkeypatch.setattr(runtime, "setup", lambda **k: pytest.fail("devices were made"))
    for main in (decode_cli.main, serve_cli.main):
        line = one_line(capsys, main(["--preset", "tiny", "--tp", "100000"]))
        assert f"--tp 100000: the model has {TINY.n_heads} query heads" in line, line
    common = ["configs/tiny.yaml", "steps=1", f"run_dir={tmp_path}", "name=x"]
    line = one_line(capsys, train_cli.main(common + ["mesh.tp=100000"]))
    assert f"mesh.tp=100000: the model has {TINY.n_heads} query heads" in line, line
    line = one_line(capsys, train_cli.main(common + ["mesh.data=100000"]))
    assert "mesh.data=100000: between 1 and data.batch_size" in line, line
    assert not os.listdir(tmp_path)
