"""The command lines' words: one-line argparse errors, help on every flag with its default,
`train --help` from the schema, and the schema's model section derived from ModelConfig."""

import argparse
import dataclasses
import functools
import pathlib
import re
import runpy
import sys
import tomllib

import pytest
import yaml

import ladder_jax as lj
from ladder_jax import train_config
from ladder_jax.cli import common, convert, decode, demo, overlap, predict, serve
from ladder_jax.cli import eval as eval_cli
from ladder_jax.cli import train as train_cli
from ladder_jax.model import quant
from tests.helpers import mesh, one_line

pytestmark = pytest.mark.quick
CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.yaml"))
MAINS = {
    "decode": decode.main,
    "convert": convert.main,
    "demo": demo.main,
    "overlap": overlap.main,
    "predict": predict.main,
    "serve": serve.main,
    "eval": eval_cli.main,
}


def _exit_line(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return one_line(capsys, e.value.code)


@pytest.mark.parametrize(
    "name, argv, expect",
    [
        ("decode", ["--seed", "1.5"], "error: --seed: invalid int value '1.5'"),
        ("decode", ["--sed", "1"], "error: unrecognized arguments: --sed 1 (did you mean --seed?)"),
        (
            "decode",
            ["--residual", "ladr"],
            "error: --residual: invalid choice: 'ladr' (choose from "
            "'standard', 'parallel', 'ladder', 'upper_bound', 'desync', 'all'); "
            "did you mean 'ladder'?",
        ),
        (
            "decode",
            ["--preset", "small", "--checkpoint", "x"],
            "error: --checkpoint: not allowed with --preset",
        ),
        ("overlap", ["--target", "b200"], "error: --target: invalid choice: 'b200'"),
        (
            "convert",
            ["--out", "x"],
            "error: one of the arguments --hf --gguf --checkpoint is required",
        ),
        (
            "convert",
            ["--hf", "x", "--out", "y", "--tp", "two"],
            "error: --tp: invalid int value 'two'",
        ),
        ("demo", ["--batch", "x"], "error: --batch: invalid int value 'x'"),
        ("predict", ["--tp", "1.5"], "error: --tp: invalid int value '1.5'"),
        *(
            (
                name,
                ["--decode-matmul", "triton"],
                "error: --decode-matmul: invalid choice: 'triton' (choose from 'xla', 'pallas')",
            )
            for name in ("decode", "serve")
        ),
    ],
)
def test_bad_flags_are_one_line(capsys, name, argv, expect):
    line = _exit_line(capsys, MAINS[name], argv)
    assert line.startswith(expect), line


def _parser_of(monkeypatch, name):
    """The argument parser command `name` builds, caught before it parses anything."""
    seen = []

    def capture(self, argv=None, namespace=None):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(common.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        MAINS[name]([])
    return seen[0]


@pytest.mark.parametrize("name", ["decode", "convert", "demo", "serve"])
def test_every_flag_has_help_and_shows_its_default(monkeypatch, capsys, name):
    parser = _parser_of(monkeypatch, name)
    bare = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert not bare, f"{name}: flags without help: {bare}"
    formatter = parser._get_formatter()
    for a in parser._actions:
        if (
            a.option_strings
            and a.default not in (None, "==SUPPRESS==")
            and not isinstance(a.default, bool)
        ):
            assert "default" in formatter._get_help_string(a), a.option_strings


@pytest.mark.parametrize(
    "name, required",
    [
        ("decode", []),
        ("predict", []),
        ("overlap", []),
        ("eval", ["--checkpoint", "runs/x"]),
        ("convert", ["--checkpoint", "runs/x", "--out", "y"]),
    ],
)
def test_quantize_none_means_float_weights(monkeypatch, name, required):
    """`--quantize none` is no quantization (as benchmarks/roofline.py takes it), in help too."""
    parser = _parser_of(monkeypatch, name)
    parse = functools.partial(argparse.ArgumentParser.parse_args, parser)
    assert parse([*required, "--quantize", "none"]).quantize is None
    assert parse([*required, "--quantize", "int8"]).quantize == "int8"
    assert parse(required).quantize is None
    assert "none: " in parser._option_string_actions["--quantize"].help


def _entry_points() -> list[str]:
    """Every `python -m ladder_jax.X`: a top-level module that runs as a script, or a package
    with a __main__.py."""
    root = pathlib.Path(lj.__file__).parent
    modules = [p.stem for p in root.glob("*.py") if '__name__ == "__main__"' in p.read_text()]
    return sorted(modules + [p.parent.name for p in root.glob("*/__main__.py")])


def test_the_entry_points_are_the_installed_scripts():
    scripts = {
        k.removeprefix("ladder-")
        for k in tomllib.loads(
            (pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text()
        )["project"]["scripts"]
    }
    assert set(_entry_points()) == scripts and len(scripts) == 8, (_entry_points(), scripts)


@pytest.mark.parametrize("name", _entry_points())
def test_help_works_for_every_entry_point(monkeypatch, capsys, name):
    """`python -m ladder_jax.NAME --help`, through the module's own `__main__` path (run
    in-process): usage naming that command on stdout, nothing on stderr, exit code 0."""
    monkeypatch.setattr(sys, "argv", [f"ladder_jax.{name}", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(f"ladder_jax.{name}", run_name="__main__", alter_sys=True)
    out, err = capsys.readouterr()
    assert e.value.code in (0, None), (e.value.code, err)
    assert out.startswith(f"usage: python -m ladder_jax.{name} ") and not err, (out[:300], err)
    assert len(out.splitlines()) > 5, out


def test_decode_help_names_the_defaults(capsys):
    with pytest.raises(SystemExit):
        decode.main(["--help"])
    text = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    for flag, default in (
        ("--max-new-tokens", "64"),
        ("--temperature", "0.8"),
        ("--seed", "0"),
        ("--batch", "1"),
        ("--prompt-len", "1024"),
    ):
        m = re.search(rf"^  {flag} \S+(.*?)(?=^  -|\Z)", text, flags=re.S | re.M)
        entry = " ".join(m.group(1).split())
        assert entry.endswith(f"(default: {default})") and len(entry) > 25, (flag, entry)


def test_train_help_lists_every_key_with_default_and_description(capsys):
    assert train_cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    rows = {}
    for line in lines:
        m = re.match(r"  (\S+)\s+(\S+)\s+(\S.*)$", line)
        if m and not line.startswith("   "):
            rows[m.group(1)] = (m.group(2), m.group(3))
    keys = [k for k, _, _, section in train_config.help_rows() if not section]
    assert set(keys) <= set(rows), set(keys) - set(rows)
    assert len(keys) > 50
    assert rows["steps"][0] == "1000" and rows["model.residual"][0] == "standard"
    assert rows["model.d_model"][0] == "null" and "residual stream" in rows["model.d_model"][1]
    assert rows["progress"][0] == "auto" and rows["mesh.fsdp"][0] == "false"
    first_key = next(i for i, ln in enumerate(lines) if ln.startswith("  name "))
    assert first_key < 10  # the keys come first, the prose after
    assert "deadlock" not in text and "XLA:CPU" not in text


def test_the_model_section_is_modelconfigs_fields():
    section = {f.name: f for f in dataclasses.fields(train_config.ModelSection)}
    model = [f.name for f in dataclasses.fields(lj.ModelConfig)]
    assert list(section) == ["preset", *model]
    for f in dataclasses.fields(lj.ModelConfig):
        assert f.metadata["help"] == section[f.name].metadata["help"] != ""
    # every field overrides the preset from a key=value ...
    cfg = train_config.load_config(
        [
            "model.d_model=128",
            "model.n_heads=4",
            "model.norm_eps=1e-6",
            "model.tie_embeddings=true",
            "model.remat=module",
            "model.residual=ladder",
            "model.ladder_layers=[0,2]",
        ]
    )
    got = train_config.model_config(cfg)
    want = lj.ModelConfig.from_preset(
        "tiny",
        d_model=128,
        n_heads=4,
        norm_eps=1e-6,
        tie_embeddings=True,
        remat="module",
        residual="ladder",
        ladder_layers=(0, 2),
    )
    assert got == want and type(got.residual) is str and type(got.remat) is str


@pytest.mark.parametrize("file", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_loads_as_its_yaml_says(file):
    raw = yaml.safe_load(file.read_text()).get("model", {})
    over = {
        k: (tuple(v) if isinstance(v, list) else v)
        for k, v in raw.items()
        if k != "preset" and v is not None
    }
    over.setdefault("param_dtype", "float32")  # the training schema's own default
    want = lj.ModelConfig.from_preset(raw.get("preset", "tiny"), **over)
    assert train_config.model_config(train_config.load_config([str(file)])) == want


@pytest.mark.parametrize(
    "arg, expect",
    [
        (
            "model.residual=ladr",
            "model.residual='ladr' (did you mean 'ladder'?): choose one of "
            "standard, parallel, ladder, upper_bound, desync",
        ),
        ("model.remat=layers", "model.remat='layers': choose one of none, module, matmuls"),
        (
            "progress=bars",
            "progress='bars' (did you mean 'bar'?): choose one of auto, bar, lines, none",
        ),
        ("model.n_layers=x", "config key 'model.n_layers' must be int or null, got 'x'"),
    ],
)
def test_choices_are_checked_by_the_schema(arg, expect):
    with pytest.raises(lj.ConfigError) as e:
        train_config.load_config([arg])
    assert str(e.value) == expect


@pytest.mark.parametrize("flags", [[], ["--decode-matmul", "pallas"], ["--decode-matmul", "xla"]])
def test_decode_matmul_reaches_decode_and_serve_models(flags):
    """--decode-matmul sets ModelConfig.decode_matmul of the model decode and serve build (the
    preset's xla when left out), beside the scheme flags; on a CPU mesh the linear layers run
    XLA's matmul whatever it says."""
    argv = ["--preset", "tiny", "--residual", "ladder", "--ladder-layers", "1", *flags]
    want = flags[1] if flags else "xla"
    _, _, config = decode._load(decode.parser().parse_args(argv), mesh(1), print)
    model, _, name = serve._load(serve.parser().parse_args(argv), mesh(1))
    for c in (config, model.config):
        assert (c.decode_matmul, c.residual, c.ladder_layers) == (want, "ladder", 1)
    assert name == "tiny" and {n.matmul for n in quant.linears(model)} == {"xla"}


def test_run_settings_leave_out_each_hosts_own_flags():
    """The flags many processes must agree on: every flag but the ones each host sets for
    itself (decode) or process 0 alone uses (serve)."""
    argv = ["--preset", "tiny", "--decode-matmul", "pallas", "--cpu-devices", "2"]
    got = common.run_settings(decode.parser().parse_args(argv))
    assert got["weights"] is None and got["flags"]["decode_matmul"] == "pallas"
    assert not {"cpu_devices", "coordinator", "process_id", "num_processes"} & set(got["flags"])
    flags = common.run_settings(
        serve.parser().parse_args([*argv, "--port", "9", "--slots", "3"]), serve._PER_PROCESS
    )["flags"]
    assert flags["slots"] == 3 and flags["decode_matmul"] == "pallas"
    assert not {"port", "host", "api_key", "cpu_devices"} & set(flags)


def _config_yaml(directory, tokenizer, *, checkpoints=True):
    directory.mkdir(parents=True, exist_ok=True)
    if checkpoints:
        (directory / "checkpoints").mkdir(exist_ok=True)
    file = directory / "config.yaml"
    file.write_text(f"model:\n  preset: tiny\ndata:\n  tokenizer: {tokenizer}\n")
    return str(file)


def test_a_config_files_tokenizer_is_found_from_wherever_the_file_is(tmp_path, monkeypatch):
    """data.tokenizer of a config file: relative to the file's directory (else the working
    directory, as before); a path that is gone falls back to the tokenizer.json beside the
    file; a model directory's config.yaml whose tokenizer is nowhere is one ConfigError."""
    out = tmp_path / "out"
    file = _config_yaml(out, "tokenizer.json")
    (out / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "out" / "checkpoints")  # anywhere but beside it
    assert train_config.load_config([file]).data.tokenizer == str(out / "tokenizer.json")
    stale = _config_yaml(tmp_path / "moved", str(tmp_path / "gone" / "tokenizer.json"))
    (tmp_path / "moved" / "tokenizer.json").write_text("{}")
    assert train_config.load_config([stale]).data.tokenizer == str(
        tmp_path / "moved/tokenizer.json"
    )
    (tmp_path / "cwd" / "tok").mkdir(parents=True)
    (tmp_path / "cwd" / "tok" / "t.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "cwd")
    train = _config_yaml(tmp_path / "configs", "tok/t.json", checkpoints=False)
    assert train_config.load_config([train]).data.tokenizer == "tok/t.json"  # the working dir's
    later = _config_yaml(tmp_path / "configs", "runs/x/tokenizer.json", checkpoints=False)
    assert train_config.load_config([later]).data.tokenizer == "runs/x/tokenizer.json"
    assert train_config.load_config([later, "data.tokenizer=byte"]).data.tokenizer == "byte"
    lost = _config_yaml(tmp_path / "lost", "/nowhere/tokenizer.json")
    with pytest.raises(lj.ConfigError) as e:
        train_config.load_config([lost])
    assert str(e.value) == (
        f"{lost}: data.tokenizer='/nowhere/tokenizer.json' is not there, nor is a "
        f"tokenizer.json beside the file: copy the model's tokenizer.json into {tmp_path}/lost"
    )
