"""Bad input ends in one line that names the file / tensor / prompt and the fix, exit code 2, no
traceback, and nothing written: training data through `train_cli.main`, Hugging Face files through
`convert.main` and `load_hf`, generation through `generate` and `decode_cli.main`."""

import json
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

import ladder_jax as lj
from ladder_jax.cli import convert
from ladder_jax.cli import decode as decode_cli
from ladder_jax.cli import train as train_cli
from ladder_jax.inference import generation
from ladder_jax.interop import hf
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.train import data
from tests import helpers
from tests.helpers import cli_error, one_line

SMALL = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.batch_size=8",
    "eval_batches=2",
    "progress=none",
    "log_every=1000",
    "mesh.data=1",
    "steps=1",
    "eval_every=0",
]


# ---------------------------------------------------------------------------------------------
# Training data.


def _npy(values, dtype=np.int32):
    return lambda f: np.save(f, np.asarray(values, dtype))


def _bytes(raw):
    def write(f):
        with open(f, "wb") as fh:
            fh.write(raw)

    return write


def _truncated_npy(f):
    np.save(f, np.arange(5000, dtype=np.int32))
    with open(f, "r+b") as fh:
        fh.truncate(1000)


def _object_npy(f):
    np.save(f, np.array([[1], [2, 3]], dtype=object), allow_pickle=True)


def _empty_dir(d):
    os.makedirs(d)
    for name in ("a.txt", "b.txt"):
        open(os.path.join(d, name), "w").close()


RNG_BYTES = bytes(np.random.default_rng(0).integers(1, 256, 4000, dtype=np.uint8))


@pytest.mark.parametrize(
    "name, make, expect",
    [
        (
            "neg.npy",
            _npy([5, -1, 7] * 3000),
            [
                "3000 of 9000 token ids are outside the model's vocabulary [0, 320)",
                "smallest -1",
                "negative ids",
            ],
        ),
        (
            "big.npy",
            _npy(np.arange(9000) % 400),
            [
                "token ids are outside the model's vocabulary [0, 320)",
                "largest 399",
                "model.vocab_size >= 400",
            ],
        ),
        ("big64.npy", _npy([1, 2, 2**40] * 3000, np.int64), ["largest 1099511627776"]),
        ("obj.npy", _object_npy, ["holds Python objects", "numpy.save"]),
        ("garbage.npy", _bytes(RNG_BYTES), ["is not a .npy file", "numpy.save"]),
        ("cut.npy", _truncated_npy, ["is damaged"]),
        ("twod.npy", _npy(np.zeros((4, 100))), ["must be a 1-D integer array"]),
        (
            "program.txt",
            _bytes(b"\x7fELF\x02\x01\x01\x00" + RNG_BYTES),
            ["has NUL bytes", "not text"],
        ),
        ("noise.txt", _bytes(RNG_BYTES), ["bytes not UTF-8", "not text"]),
        ("empty.txt", _bytes(b""), ["empty, no tokens to train on"]),
        ("emptydir", _empty_dir, ["(2 files): empty, no tokens to train on"]),
        ("empty.npy", _npy([]), ["empty, no tokens to train on"]),
    ],
)
def test_bad_training_data_is_one_line_and_writes_nothing(tmp_path, capsys, name, make, expect):
    path = str(tmp_path / name)
    make(path)
    rc = train_cli.main(SMALL + [f"data.path={path}", f"run_dir={tmp_path}/runs", "name=r"])
    line = one_line(capsys, rc)
    assert path in line and all(e in line for e in expect), line
    assert not os.path.exists(tmp_path / "runs")  # refused before the run directory exists


def test_unreadable_tokenizer_json_is_one_line(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    rc = train_cli.main(
        SMALL + [f"data.tokenizer={tmp_path}/tokenizer.json", f"run_dir={tmp_path}/runs", "name=r"]
    )
    line = one_line(capsys, rc)
    assert f"{tmp_path}/tokenizer.json is not a tokenizer.json the tokenizers package" in line
    assert not os.path.exists(tmp_path / "runs")


def test_data_checks_pass_what_is_good(tmp_path):
    tok = ByteTokenizer()
    np.save(tmp_path / "ok.npy", np.arange(320, dtype=np.int16))
    assert data.load_tokens(str(tmp_path / "ok.npy"), tok, vocab_size=320)[-1] == 319
    with pytest.raises(data.DataError, match="largest 320"):
        np.save(tmp_path / "ok.npy", np.arange(321, dtype=np.int16))
        data.load_tokens(str(tmp_path / "ok.npy"), tok, vocab_size=320)
    # one stray byte in text is replaced, not refused; NUL is refused wherever it is
    (tmp_path / "t.txt").write_bytes(b"a" * 200 + b"\xff" + b"b" * 200)
    assert 0xFF not in data.load_tokens(str(tmp_path / "t.txt"), tok).tolist()
    (tmp_path / "t.txt").write_bytes(b"a" * 200 + b"\x00")
    with pytest.raises(data.DataError, match="NUL"):
        data.load_tokens(str(tmp_path / "t.txt"), tok)


# ---------------------------------------------------------------------------------------------
# Hugging Face files.


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    config = lj.ModelConfig.from_preset("tiny", n_layers=1)
    mesh = helpers.mesh(1)
    lj.save_hf(lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)), path)
    return path


def _copy(src, dst):
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(src / f, "rb") as a, open(dst / f, "wb") as b:
            b.write(a.read())
    return dst


def _st_parts(file):
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_write(file, header, body, *, length=None, raw_header=None):
    h = json.dumps(header).encode() if raw_header is None else raw_header
    file.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + body)


UP = "model.layers.0.mlp.up_proj.weight"


def _edit_entry(key, value):
    def edit(d):
        header, body = _st_parts(d / hf.SINGLE)
        if value is None:
            del header[UP][key]
        else:
            header[UP][key] = value(header[UP][key])
        _st_write(d / hf.SINGLE, header, body)

    return edit


def _nan(d):
    header, body = _st_parts(d / hf.SINGLE)
    start = header[UP]["data_offsets"][0] + 4 * 7
    body = body[:start] + struct.pack("<f", float("nan")) + body[start + 4 :]
    _st_write(d / hf.SINGLE, header, body)


def _index(weight_map):
    def edit(d):
        header, _ = _st_parts(d / hf.SINGLE)
        wm = (
            {k: hf.SINGLE for k in header if k != "__metadata__"}
            if weight_map is None
            else (weight_map)
        )
        if weight_map is None:
            wm[UP] = "model-00002-of-00002.safetensors"
        (d / hf.INDEX).write_text(
            wm
            if isinstance(wm, str)
            else json.dumps(wm if weight_map == [] else {"weight_map": wm})
        )

    return edit


def _index_outside(d):
    """An index whose weight_map names a file outside the model directory (which exists)."""
    header, _ = _st_parts(d / hf.SINGLE)
    os.rename(d / hf.SINGLE, d.parent / "x.safetensors")
    (d / hf.INDEX).write_text(
        json.dumps({"weight_map": {k: "../x.safetensors" for k in header if k != "__metadata__"}})
    )


def _config(**changes):
    def edit(d):
        cfg = json.loads((d / hf.CONFIG).read_text())
        (d / hf.CONFIG).write_text(json.dumps({**cfg, **changes}))

    return edit


HEADER_DAMAGE = [  # (name, damage, what the line says); all must fail before any tensor read
    (
        "truncated",
        lambda d: (d / hf.SINGLE).write_bytes((d / hf.SINGLE).read_bytes()[:-100]),
        [
            "model.safetensors is not a valid safetensors file",
            "past the",
            "truncated",
            "fetch it again",
        ],
    ),
    (
        "stub",
        lambda d: (d / hf.SINGLE).write_bytes(b"\x01\x02\x03"),
        ["3 bytes, too short for a header"],
    ),
    (
        "huge_length",
        lambda d: _st_write(d / hf.SINGLE, *_st_parts(d / hf.SINGLE), length=2**62),
        [f"header length field says {2**62} bytes"],
    ),
    (
        "list_header",
        lambda d: _st_write(d / hf.SINGLE, [1, 2], b""),
        ["header is a JSON list, not an object"],
    ),
    (
        "not_json",
        lambda d: _st_write(d / hf.SINGLE, None, b"", raw_header=b"{oops"),
        ["header is not JSON"],
    ),
    (
        "no_offsets",
        _edit_entry("data_offsets", None),
        [f"tensor {UP!r}: its entry needs dtype, shape and data_offsets"],
    ),
    (
        "bad_offsets",
        _edit_entry("data_offsets", lambda o: [o[0], o[1] - 4]),
        [f"tensor {UP!r}", "bytes do not hold shape (128, 64) of F32"],
    ),
    (
        "past_end",
        _edit_entry("data_offsets", lambda o: [o[0] + 10**9, o[1] + 10**9]),
        ["past the", "truncated?"],
    ),
    ("bad_shape", _edit_entry("shape", lambda s: "big"), ["shape 'big' is not a list"]),
    ("unknown_dtype", _edit_entry("dtype", lambda t: "Q9"), ["unknown dtype 'Q9'"]),
    (
        "int_dtype",
        _edit_entry("dtype", lambda t: "I32"),
        [f"tensor {UP!r} has dtype I32, which cannot be imported"],
    ),
    (
        "config_list",
        lambda d: (d / hf.CONFIG).write_text("[1, 2]"),
        ["config.json holds a JSON list, not an object"],
    ),
    (
        "config_str",
        _config(vocab_size="320"),
        ["config.json: vocab_size='320' must be a positive integer"],
    ),
    (
        "config_bool",
        _config(tie_word_embeddings="false"),
        ["tie_word_embeddings='false' must be true or false"],
    ),
    ("config_eps", _config(rms_norm_eps=[1e-6]), ["rms_norm_eps=[1e-06] must be a positive"]),
    (
        "config_rope",
        _config(rope_parameters=["llama3"]),
        ["rope_parameters=['llama3'] must be an object"],
    ),
    (
        "shard_missing",
        _index(None),
        ["lists 'model-00002-of-00002.safetensors', which is not in", "download is incomplete"],
    ),
    ("index_list", _index([]), ['has no "weight_map" object']),
    ("index_garbage", _index("{not json"), ["cannot read", hf.INDEX]),
    (
        "index_outside",
        _index_outside,
        ["lists '../x.safetensors', which is not a file name in", "no directories, no '..'"],
    ),
    (
        "tokenizer_garbage",
        lambda d: (d / hf.TOKENIZER).write_text("{not a tokenizer"),
        ["tokenizer.json is not a tokenizer.json the tokenizers package can read"],
    ),
]


@pytest.mark.parametrize("name, damage, expect", HEADER_DAMAGE, ids=[c[0] for c in HEADER_DAMAGE])
def test_damaged_hf_checkpoint_fails_before_any_tensor_is_read(
    hf_dir, tmp_path, capsys, monkeypatch, name, damage, expect
):
    if name == "tokenizer_garbage":
        pytest.importorskip("tokenizers")
    d = _copy(hf_dir, tmp_path / name)
    damage(d)
    reads = []
    real_read = hf._SafetensorsFile.read
    monkeypatch.setattr(
        hf._SafetensorsFile, "read", lambda self, n: reads.append(n) or real_read(self, n)
    )
    out = tmp_path / "out"
    line = one_line(capsys, convert.main(["--hf", str(d), "--out", str(out)]))
    assert all(e in line for e in expect) and line.count(" is not ") <= 2, line
    assert reads == [] and not out.exists()


def test_save_hf_refuses_a_non_empty_directory(model, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(hf.HFError, match="exists and is not an empty directory.*overwrite=True"):
        lj.save_hf(model, tmp_path)
    assert os.listdir(tmp_path) == ["notes.txt"]
    with pytest.raises(hf.HFError, match="max_shard_bytes=-5 must be a positive"):
        lj.save_hf(model, tmp_path / "new", max_shard_bytes=-5)
    lj.save_hf(model, tmp_path, overwrite=True)
    assert (tmp_path / hf.SINGLE).is_file() and (tmp_path / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "args, expect",
    [
        (
            ["--param-dtype", "int32"],
            "--param-dtype 'int32' is not a floating-point dtype: choose "
            "float32, bfloat16 or float16",
        ),
        (["--param-dtype", "foo"], "--param-dtype 'foo' is not a dtype name"),
        (["--to-hf", "--max-shard-bytes", "-5"], "--max-shard-bytes -5 must be a positive number"),
    ],
)
def test_convert_flags_are_checked_before_reading(hf_dir, tmp_path, capsys, args, expect):
    line = one_line(
        capsys, convert.main(["--hf", str(hf_dir), "--out", str(tmp_path / "o"), *args])
    )
    assert expect in line and "config.json" not in line, line
    assert not (tmp_path / "o").exists()


def test_nan_weights_are_refused_naming_the_tensor(hf_dir, tmp_path, capsys):
    d = _copy(hf_dir, tmp_path / "nan")
    _nan(d)
    with pytest.raises(hf.HFError, match=rf"tensor '{re.escape(UP)}' has 1 NaN/inf values"):
        lj.load_hf(d, mesh=helpers.mesh(1))
    line = one_line(capsys, convert.main(["--hf", str(d), "--out", str(tmp_path / "out")]))
    assert str(d / hf.SINGLE) in line and UP in line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Generation: the API.


@pytest.fixture(scope="module")
def model():
    mesh = helpers.mesh(1)
    return lj.Transformer(
        lj.ModelConfig.from_preset("tiny", n_layers=1), mesh=mesh, rngs=nnx.Rngs(0)
    )


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[1.0, 2]], r"prompt 0 has 1.0 \(float\) at position 0: token ids must be integers"),
        ([[3], ["1", "2"]], r"prompt 1 has '1' \(str\) at position 0"),
        ([[5, True]], r"prompt 0 has True \(bool\) at position 1"),
        ([[5, np.float32(2)]], r"prompt 0 has .*2\.0.* \(float32\) at position 1"),
        ([b"hello"], "prompt 0 is bytes: decode it to a str"),
        ([np.array([1.0, 2.0])], r"prompt 0 is an array of float64 .*astype"),
        (
            np.array([1, 2, 3]),
            r"must be 2-D \(batch, length\).*shape \(3,\): for one prompt pass "
            r"ids\[None\]",
        ),
        (np.zeros((1, 2, 3), np.int32), r"shape \(1, 2, 3\)"),
        ([1, 2, 3], r"one list of token ids, not a batch of prompts: pass \[ids\]"),
        ("hello", r"pass \[prompt\]"),
        (["hello", [1, 2]], "prompts mix strings and token lists"),
        ([7], "one list of token ids"),
        ([None], "prompt 0 is a NoneType"),
        (5, "not int"),
    ],
)
def test_generate_refuses_what_is_not_a_token_id(model, prompts, match):
    with pytest.raises(generation.GenerationError, match=match):
        generation.generate(model, prompts, max_new_tokens=2)


def test_generate_takes_numpy_ids_as_given(model):
    want = generation.generate(model, [[5, 6, 7], [8, 9, 10]], max_new_tokens=3)
    assert generation.generate(model, np.array([[5, 6, 7], [8, 9, 10]]), max_new_tokens=3) == want
    assert (
        generation.generate(
            model, [np.array([5, 6, 7], np.int64), np.array([8, 9, 10])], max_new_tokens=3
        )
        == want
    )
    assert generation.generate(model, [[np.int32(5), 6, 7], [8, 9, 10]], max_new_tokens=3) == want


@pytest.mark.parametrize(
    "prompt_len, new, fix",
    [
        (10, 300, "lower max_new_tokens to <= 246"),  # the prompt is not the problem
        (200, 100, "shorten the prompt to <= 156 tokens or lower max_new_tokens to <= 56"),
        (
            300,
            8,
            "max_seq_len=256 positions including the new tokens: shorten the prompt to <= "
            "248 tokens",
        ),
        (300, 300, "shorten the prompt and lower max_new_tokens: together they must be <= 256"),
    ],
)
def test_too_long_names_only_fixes_that_work(model, prompt_len, new, fix):
    with pytest.raises(generation.GenerationError) as e:
        generation.generate(model, [[1] * prompt_len], max_new_tokens=new)
    msg = str(e.value)
    assert msg.endswith(fix) and not re.search(r"<= -?0\b|<= -", msg), msg


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=float("nan")), "temperature=nan must be >= 0 and finite"),
        (dict(temperature="0.5"), "temperature='0.5' must be"),
        (dict(temperature=1.0, top_k=2.5), "top_k=2.5 must be an integer"),
        (dict(temperature=1.0, top_k=True), "top_k=True must be an integer"),
        (dict(temperature=1.0, top_p=float("nan")), r"top_p=nan must be in \(0, 1\]"),
        (dict(max_new_tokens=True), "max_new_tokens=True must be a positive integer"),
        (dict(max_new_tokens=2.0), "max_new_tokens=2.0 must be a positive integer"),
    ],
)
def test_sampling_settings_are_checked(model, kwargs, match):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(generation.GenerationError, match=match):
        generation.generate(model, [[1, 2]], **kwargs)


# ---------------------------------------------------------------------------------------------
# Generation: the CLI.


@pytest.fixture
def decode_main():
    # The fake devices are set up already (conftest); the CLI's runtime setup keeps them.
    return decode_cli.main


def _files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n   \n\t\n")
    (tmp_path / "latin1.txt").write_bytes(("x" * 9000 + "\r\ncafé\n").encode("latin-1"))
    return tmp_path


@pytest.mark.parametrize(
    "args, expect",
    [
        (
            ["--prompt-file", "{tmp}/empty.txt"],
            "{tmp}/empty.txt has no prompts (it is empty or only blank lines)",
        ),
        (["--prompt-file", "{tmp}/blank.txt"], "{tmp}/blank.txt has no prompts"),
        (
            ["--prompt-file", "{tmp}/latin1.txt"],
            "--prompt-file {tmp}/latin1.txt: byte 9005 (line 2) is not UTF-8",
        ),
        (["--prompt-file", "{tmp}"], "--prompt-file {tmp}: cannot read it (Is a directory)"),
        (["--prompt-file", "{tmp}/nope.txt"], "cannot read it (No such file or directory)"),
        (["--max-new-tokens", "0"], "max_new_tokens=0 must be a positive integer"),
        (["--max-new-tokens", "-3"], "max_new_tokens=-3 must be a positive integer"),
        (
            ["--max-new-tokens", "400"],
            "that is 417 positions, but the cache holds max_seq_len=256: "
            "lower max_new_tokens to <= 239",
        ),
        (["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--temperature", "nan"], "temperature=nan must be >= 0 and finite"),
        (["--top-k", "0"], "top_k=0 must be an integer from 1 to the vocabulary size 320"),
        (  # the heads (what to change) before the 8 devices 3 does not divide either
            ["--tp", "3"],
            "error: n_heads=8 is not divisible by tp=3: use a tp that divides 8 (set by --tp; "
            "e.g. --tp 2)",
        ),
        (["--tp", "0"], "--tp 0: give the number of devices to spread over, at least 1"),
        (
            ["--residual", "standard", "--ladder-layers", "2"],
            "--ladder-layers applies to --residual ladder",
        ),
        (
            ["--benchmark", "--max-new-tokens", "1", "--prompt-len", "4"],
            "new_tokens=1 (--max-new-tokens) must be an integer >= 2",
        ),
        (["--benchmark", "--batch", "0", "--prompt-len", "4"], "batch=0 (--batch) must be"),
        (["--benchmark", "--prompt-len", "0"], "prompt_len=0 (--prompt-len) must be"),
        (
            ["--ladder-layers", "2,x"],
            "--ladder-layers '2,x': give N (the upper N layers) or a comma list",
        ),
    ],
)
def test_decode_cli_bad_input_is_one_line(tmp_path, capsys, decode_main, args, expect):
    tmp = str(_files(tmp_path))
    rc = decode_main([a.replace("{tmp}", tmp) for a in args])
    line = one_line(capsys, rc)
    assert expect.replace("{tmp}", tmp) in line, line


def test_a_tp_above_the_devices_is_one_line(capsys):
    """--tp 16 on the 8 fake devices: one line naming the flag and the device count, exit 2,
    no traceback, in decode and serve; `lj.load(tp=16)` raises the same as a ShardingError."""
    from ladder_jax.cli import serve

    for main in (decode_cli.main, serve.main):
        line = cli_error(capsys, main, ["--preset", "3b", "--tp", "16"])  # 32 heads split 16 ways
        assert line == "error: --tp 16: between 1 and the 8 devices", line
        line = cli_error(capsys, main, ["--preset", "tiny", "--tp", "16"])  # 8 heads cannot
        assert line == (
            "error: --tp 16: the model has 8 query heads and each device holds whole heads, "
            "so --tp can be at most 8"
        ), line
    with pytest.raises(lj.ShardingError, match=r"^tp 16: between 1 and the 8 devices$"):
        lj.load("runs/never-read", tp=16)


def test_prompt_file_lines_are_prompts(tmp_path, capsys, decode_main):
    (tmp_path / "p.txt").write_bytes(b"ab\r\n\r\n  \ncd\n")  # Windows line ends, blank lines
    assert (
        decode_main(
            [
                "--prompt-file",
                str(tmp_path / "p.txt"),
                "--max-new-tokens",
                "1",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--- 'ab'\n" in out and "--- 'cd'\n" in out and out.count("--- ") == 2, out


def test_decode_benchmark_says_what_it_measures_first(capsys, decode_main, monkeypatch):
    printed = []  # what stdout held when each (slow) measurement started

    def fake(config, mesh, *, batch, prompt_len, new_tokens):
        printed.append(capsys.readouterr().out)
        return {
            "residual": config.residual,
            "prefill_ms": 1.0,
            "decode_ms_per_token": 1.0,
            "decode_tokens_per_s_per_user": 1.0,
            "decode_tokens_per_s": 3.0,
            "tokens_per_s": 2.0,
            "roofline_fraction": 0.5,
            "first_run_s_incl_compile": 1.0,
            "bandwidth_bytes_per_s": 1e9,
            "bandwidth_source": "test",
        }

    monkeypatch.setattr(decode_cli, "benchmark", fake)
    args = ["--benchmark", "--batch", "3", "--prompt-len", "5", "--max-new-tokens", "7"]
    assert decode_main(args + ["--residual", "all", "--tp", "8"]) == 0
    header = printed[0]
    assert header.count("\n") == 1 and printed[1].startswith("standard "), printed
    for part in (
        "decode benchmark, random weights of preset tiny",
        "residual standard, parallel, ladder, upper_bound",
        "tp=8 on 8 cpu device(s)",
        "batch 3",
        "prompt 5 tokens",
        "7 new tokens",
    ):
        assert part in header, header
    out = capsys.readouterr().out.splitlines()  # the ratios, then the word that on CPU
    at = next(i for i, line in enumerate(out) if line.startswith("decode speed vs standard"))
    assert out[at + 1].startswith("note: XLA:CPU runs all-reduces synchronously") and (
        "these ratios are noise" in out[at + 1]
    ), out
    assert decode_main(args + ["--residual", "all", "--tp", "1"]) == 0
    assert "note: tp=1 has no all-reduce to overlap" in capsys.readouterr().out
    assert decode_main(args + ["--json"]) == 0  # JSON lines only
    assert all(json.loads(line) for line in capsys.readouterr().out.splitlines())


def test_decode_cli_process_non_utf8_prompt_file(tmp_path):
    """The real process: exit code 2 and one line, nothing else on stderr from us."""
    (tmp_path / "p.txt").write_bytes(b"\xff\xfe h\x00i\n")
    r = helpers.run_module("decode", "--prompt-file", str(tmp_path / "p.txt"))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"--prompt-file {tmp_path / 'p.txt'}: byte 0 (line 1) is not UTF-8" in r.stderr


# ---------------------------------------------------------------------------------------------
# Training: configs, resume and the run directory.


def _snapshot(path):
    """{relative file: bytes} of a directory, to show that a refused command changed nothing."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run with a checkpoint at step 2 (shared by the resume cases, copied per test)."""
    root = tmp_path_factory.mktemp("trained")
    assert train_cli.main(SMALL + ["steps=2", f"run_dir={root}", "name=run"]) == 0
    return root


def _copy_run(trained, tmp_path):
    import shutil

    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path


@pytest.mark.parametrize(
    "change, key",
    [
        ("model.residual=ladder", "model.residual: 'standard' -> 'ladder'"),
        ("data.seed=7", "data.seed: 0 -> 7"),
        ("optim.peak_lr=0.01", "optim.peak_lr: 0.0003 -> 0.01"),
    ],
)
def test_resume_with_a_changed_experiment_is_refused_and_writes_nothing(
    trained, tmp_path, capsys, change, key
):
    root = _copy_run(trained, tmp_path)
    before = _snapshot(root / "run")
    line = one_line(
        capsys, train_cli.main(SMALL + ["steps=4", f"run_dir={root}", "name=run", change])
    )
    assert key in line and "accept_changes=true" in line and "name=" in line, line
    assert _snapshot(root / "run") == before


def test_accept_changes_resumes_and_records_what_changed(trained, tmp_path, capsys):
    root = _copy_run(trained, tmp_path)
    assert (
        train_cli.main(
            SMALL
            + [
                "steps=3",
                f"run_dir={root}",
                "name=run",
                "optim.peak_lr=0.01",
                "accept_changes=true",
            ]
        )
        == 0
    )
    assert "resumed from" in capsys.readouterr().out
    with open(root / "run" / "changes.jsonl") as f:
        rec = json.loads(f.readline())
    assert rec["step"] == 2 and rec["changed"]["optim.peak_lr"] == [0.0003, 0.01]
    with open(root / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]


def test_resume_after_a_shape_change_names_the_weight_and_writes_nothing(trained, tmp_path, capsys):
    root = _copy_run(trained, tmp_path)
    before = _snapshot(root / "run")
    line = one_line(
        capsys,
        train_cli.main(
            SMALL
            + ["steps=4", f"run_dir={root}", "name=run", "model.d_ff=256", "accept_changes=true"]
        ),
    )
    assert "layers/0/mlp/down" in line and "(128, 64)" in line and "(256, 64)" in line, line
    assert "new name=" in line
    assert _snapshot(root / "run") == before


def test_torn_last_metrics_line_is_dropped_on_resume(trained, tmp_path, capsys):
    root = _copy_run(trained, tmp_path)
    with open(root / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.2')  # a write cut short by a crash
    assert train_cli.main(SMALL + ["steps=3", f"run_dir={root}", "name=run"]) == 0
    assert "torn last line" in capsys.readouterr().out
    with open(root / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]


def test_damaged_metrics_in_the_middle_is_one_line(trained, tmp_path, capsys):
    root = _copy_run(trained, tmp_path)
    p = root / "run" / "metrics.jsonl"
    p.write_text("garbage\n" + p.read_text())
    before = _snapshot(root / "run")
    line = one_line(capsys, train_cli.main(SMALL + ["steps=3", f"run_dir={root}", "name=run"]))
    assert "metrics.jsonl, line 1" in line
    assert _snapshot(root / "run") == before


def test_init_from_problems_are_one_line(trained, tmp_path, capsys):
    line = one_line(
        capsys,
        train_cli.main(SMALL + [f"run_dir={tmp_path}", "name=ft", f"init_from={tmp_path}/nope"]),
    )
    assert "init_from" in line and "does not exist" in line
    line = one_line(
        capsys,
        train_cli.main(
            SMALL + [f"run_dir={tmp_path}", "name=ft", f"init_from={trained}/run", "model.d_ff=256"]
        ),
    )
    assert "init_from" in line and "(128, 64)" in line and "(256, 64)" in line
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize(
    "args, expect",
    [
        (["optim.peak_lr=-1"], "optim.peak_lr=-1.0 must be positive"),
        (["optim.b2=1.5"], "optim.b2=1.5 must be in [0.0, 1.0)"),
        (["data.eval_fraction=1"], "data.eval_fraction=1.0 must be in [0.0, 1.0)"),
        (["optim.warmup_steps=-5"], "optim.warmup_steps=-5 must be >= 0"),
        (["mesh.data=0"], "mesh.data=0 must be positive"),
        (["model.remat=layers"], "remat='layers'"),
        (["model.rope_theta=0"], "rope_theta=0.0 must be a positive finite number"),
        (["model.rope_theta=nan"], "rope_theta=nan must be a positive finite number"),
        (["model.norm_eps=-1"], "norm_eps=-1.0 must be a positive finite number"),
        (["model.head_dim=0"], "head_dim=0 must be a positive even integer"),
        (["model.head_dim=-2"], "head_dim=-2 must be a positive even integer"),
        (["model.rope_scaling=5"], "rope_scaling=5 must be null or a mapping of factor"),
        (["model.rope_scaling={factor: -1}"], "rope_scaling.factor=-1 must be a positive"),
        (["model.rope_scaling={size: 2}"], "rope_scaling has no field 'size'"),
        (["model.dtype=int32"], "dtype='int32' is not a floating-point dtype: choose float32"),
        (["model.param_dtype=int8"], "param_dtype='int8' is not a floating-point dtype"),
        (["model.dtype=floaty"], "dtype='floaty' is not a dtype name"),
        (["model.vocab_size=500000000"], "GB of host memory but"),
        (["name=../../escaped"], "name='../../escaped' must be a plain directory name"),
        (["name=a/b"], "name='a/b' must be a plain directory name"),
        (["name=.."], "set run_dir="),
        (["model=5"], "config key 'model' is a section, not a value: set its keys (e.g. model."),
        (["data.seed=-1"], "data.seed=-1 must be in [0, 2**32)"),
        (["seed=99999999999999999999"], "seed=99999999999999999999 does not fit in 64 bits"),
        (["optim.weight_decay=nan"], "optim.weight_decay=nan must be >= 0"),
        (["peak_tflops=-3"], "peak_tflops=-3.0 must be positive"),
        (
            ["data.path=..."],
            "override data.path='...': the value is not valid YAML (did not find "
            "expected node content) (a placeholder: put the real value there)",
        ),
        (["data.path=a: b: c"], "override data.path='a: b: c': the value is not valid YAML"),
    ],
)
def test_out_of_range_settings_are_one_line(tmp_path, capsys, args, expect):
    line = one_line(capsys, train_cli.main(SMALL + [f"run_dir={tmp_path}", *args]))
    assert expect in line, line
    assert not os.listdir(tmp_path)


def test_unwritable_run_dir_is_one_line_before_data_or_compiling(tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # the superuser writes through permissions: a directory it cannot
        ro = "/sys"  # write in (sysfs takes no new files)
    monkeypatch.setattr(data, "load_tokens", lambda *a, **k: pytest.fail("data was loaded"))
    line = one_line(capsys, train_cli.main(SMALL + [f"run_dir={ro}/runs", "name=r"]))
    assert f"run_dir='{ro}/runs': cannot write in {ro}" in line and "writable" in line, line
    line = one_line(capsys, convert.main(["--checkpoint", str(tmp_path), "--out", f"{ro}/out"]))
    assert f"--out '{ro}/out': cannot write in {ro}" in line, line


def test_run_dir_that_is_a_file_and_bad_yaml_are_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    line = one_line(capsys, train_cli.main(SMALL + [f"run_dir={tmp_path}/file"]))
    assert "is a file" in line
    (tmp_path / "bad.yaml").write_text("model:\n  residual: ladder\ndata: [1\n")
    line = one_line(capsys, train_cli.main([str(tmp_path / "bad.yaml")]))
    assert f"{tmp_path}/bad.yaml:" in line and "not valid YAML" in line
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    line = one_line(capsys, train_cli.main([str(tmp_path / "list.yaml")]))
    assert "must be a mapping" in line


def test_decode_checkpoint_errors_name_the_flag(tmp_path, capsys):
    line = one_line(capsys, decode_cli.main(["--checkpoint", str(tmp_path / "nope")]))
    assert "--checkpoint" in line and "init_from" not in line


def test_decode_seed_and_a_model_without_tokenizer_are_one_line(hf_dir, capsys):
    line = one_line(capsys, decode_cli.main(["--seed", "99999999999999999999", "--tp", "1"]))
    assert "--seed 99999999999999999999 does not fit in 64 bits" in line
    assert not (hf_dir / hf.TOKENIZER).exists()
    # a byte-level vocabulary decodes with the byte tokenizer and says so (a larger vocabulary
    # without tokenizer.json is refused: tests/test_hf.py)
    assert decode_cli.main(["--checkpoint", str(hf_dir), "--tp", "1", "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert f"note: {hf_dir} has no tokenizer.json" in err and "byte tokenizer is used" in err, err


def test_decode_memory_estimate_before_allocating(capsys):
    line = one_line(capsys, decode_cli.main(["--preset", "llama-3.1-405b", "--tp", "1"]))
    assert "preset 'llama-3.1-405b' (410.1B parameters in bfloat16) needs at least" in line
    assert "GB of host memory but" in line and "smaller --preset" in line, line


def test_a_checkpoint_directory_loads_like_its_run(trained, hf_dir, tmp_path, capsys):
    mesh = helpers.mesh(1)
    whole, _ = lj.load(str(trained / "run"), mesh=mesh)
    for sub in ("checkpoints", "checkpoints/2"):
        part, _ = lj.load(str(trained / "run" / sub), mesh=mesh)
        jax.tree.map(
            np.testing.assert_array_equal,
            nnx.to_pure_dict(nnx.state(part)),
            nnx.to_pure_dict(nnx.state(whole)),
        )
    with pytest.raises(lj.ConfigError, match="'/nonexistent' does not exist"):
        lj.load("/nonexistent", mesh=mesh)
    line = one_line(
        capsys, train_cli.main(SMALL + [f"run_dir={tmp_path}", "name=ft", f"init_from={hf_dir}"])
    )
    assert (
        "is a Hugging Face model directory: convert it first (python -m ladder_jax.convert "
        f"--hf {hf_dir} --out DIR)"
    ) in line, line
    assert not (tmp_path / "ft").exists()


def test_corpus_shorter_than_one_sequence_says_so(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("tiny")
    line = one_line(
        capsys,
        train_cli.main(SMALL + [f"data.path={tmp_path}/short.txt", f"run_dir={tmp_path}/runs"]),
    )
    assert "6 tokens are fewer than one record of seq_len + 1 = 33 tokens" in line, line
    assert "held-out" not in line


def test_fifo_in_data_is_skipped_or_refused_never_read(tmp_path, capsys):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("abc")
    os.mkfifo(d / "pipe")  # opening it for reading would wait for a writer forever
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("hung on the FIFO"))
    signal.alarm(60)
    try:
        assert data.load_tokens(str(d), ByteTokenizer()).tolist() == [256, 97, 98, 99, 257]
        line = one_line(
            capsys, train_cli.main(SMALL + [f"data.path={d}/pipe", f"run_dir={tmp_path}/runs"])
        )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert f"data.path='{d}/pipe' is not a regular file (a FIFO" in line, line


def test_npy_cut_short_while_training_reads_it_is_an_error_not_sigbus(tmp_path):
    f = tmp_path / "t.npy"
    np.save(f, np.arange(10_000, dtype=np.int32) % 300)
    tokens = data.load_tokens(str(f), ByteTokenizer(), vocab_size=320)
    records, _ = data.split(tokens, 32, 0.0)
    assert records[3].tolist() == (np.arange(96, 129) % 300).tolist()
    os.truncate(f, 2000)  # another process rewrites the file under the run
    with pytest.raises(data.DataError, match="was cut short while the run read it"):
        records[200]


def test_cli_start_is_quiet(tmp_path):
    """With the CUDA plugin installed and no GPU, a one-line error stays one line, and
    `python -m ladder_jax.decode` does not warn that it was imported twice."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    p = subprocess.run(
        [sys.executable, "-m", "ladder_jax.train", "optim.peak_lr=-1", f"run_dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: optim.peak_lr=-1.0 must be positive"
    ], p.stderr
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ladder_jax.decode",
            "--max-new-tokens",
            "2",
            "--tp",
            "1",
            "--prompt",
            "a",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    # nothing on stderr but decode's own lines: the model, the prompt, then the speed
    # (tokens/s, as gpt-fast prints it); stdout is the new text alone
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("Transformer(4L "), p.stderr
    assert lines[1] == "(random weights: expect noise)" and lines[2] == "a", p.stderr
    assert re.match(r"\d+ tokens in [\d.]+ s; first token after", lines[3]), p.stderr
    assert p.stdout.endswith("\n"), p.stdout


def _plugin_failure(logger, plugin: str) -> None:
    """Logs what jax's plugin discovery logs when `plugin`'s initialize() raises."""
    try:
        raise RuntimeError("Unable to load CUDA. Is it installed?")
    except RuntimeError:
        logger.exception(
            "Jax plugin configuration error: Exception when calling %s.initialize()", plugin
        )


def test_hush_missing_cuda_drops_that_one_record_only(monkeypatch, caplog):
    """Without an NVIDIA device, the record jax logs when its CUDA plugin cannot load CUDA is
    filtered out; another plugin's failure, another message of that logger and the same
    record on a host with a GPU still come through."""
    import logging

    from ladder_jax import runtime

    logger = logging.getLogger("jax._src.xla_bridge")
    monkeypatch.setattr(logger, "filters", [f for f in logger.filters if f is not runtime._HUSH])
    caplog.set_level(logging.WARNING, logger="jax._src.xla_bridge")

    monkeypatch.setattr(runtime, "has_nvidia_gpu", lambda: True)
    assert runtime.hush_missing_cuda() is False
    _plugin_failure(logger, "jax_plugins.xla_cuda12")
    assert len(caplog.records) == 1  # a GPU host: the failure is news

    caplog.clear()
    monkeypatch.setattr(runtime, "has_nvidia_gpu", lambda: False)
    assert runtime.hush_missing_cuda() is True and runtime.hush_missing_cuda() is True
    assert logger.filters.count(runtime._HUSH) == 1
    _plugin_failure(logger, "jax_plugins.xla_cuda12")
    _plugin_failure(logger, "jax_plugins.xla_cuda13")
    assert caplog.records == []
    _plugin_failure(logger, "jax_plugins.xla_rocm")
    logger.warning("Jax plugin configuration error: Plugin module %s does not exist", "x")
    logger.warning("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib")
    logging.getLogger("jax._src.other").exception(
        "Jax plugin configuration error: Exception when calling %s.initialize()",
        "jax_plugins.xla_cuda12",
    )
    assert [r.getMessage() for r in caplog.records] == [
        "Jax plugin configuration error: Exception when calling jax_plugins.xla_rocm.initialize()",
        "Jax plugin configuration error: Plugin module x does not exist",
        "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib",
        "Jax plugin configuration error: Exception when calling "
        "jax_plugins.xla_cuda12.initialize()",
    ]


def test_progress_shows_while_other_threads_compile_quietly():
    """`cli.common.write_stderr` (predict's progress line) reaches stderr at once while a compile
    elsewhere holds `quiet()`'s capture; native output inside the capture comes out when it
    ends, the plugin's noise dropped."""
    code = textwrap.dedent("""
        import os
        from ladder_jax import runtime
        from ladder_jax.cli.common import write_stderr
        with runtime.quiet():
            os.write(2, b"from the compiler\\n")
            os.write(2, b"I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine\\n")
            write_stderr("progress 1/2\\n")
        write_stderr("progress 2/2\\n")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == ["progress 1/2", "from the compiler", "progress 2/2"], p.stderr


def test_loader_errors_are_config_errors():
    """The loaders' and the mesh's own error classes are ConfigErrors, which every command
    line prints as one line with exit code 2."""
    from ladder_jax.interop.gguf import GGUFError
    from ladder_jax.model.layout import ShardingError

    for cls in (hf.HFError, GGUFError, ShardingError):
        assert issubclass(cls, lj.ConfigError), cls


def _not_gguf(tmp_path):
    (tmp_path / "model.gguf").write_text("hello, not a GGUF file\n" * 10)
    return ["--checkpoint", str(tmp_path / "model.gguf")], (
        "model.gguf is not a GGUF file (no GGUF magic): give a llama.cpp .gguf model file"
    )


def _a_file(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + bytes(60))
    return ["--checkpoint", str(tmp_path / "pytorch_model.bin")], (
        "pytorch_model.bin' is a file, not a directory: give the directory holding the model "
        "(a training run or ladder_jax.convert output: config.yaml and checkpoints/"
    )


def _not_llama(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    return ["--checkpoint", str(tmp_path)], "is not a Llama model"


@pytest.mark.parametrize(
    "name, case",
    [
        (name, case)
        for name in ("decode", "serve", "convert")
        for case in (_not_gguf, _not_llama, _a_file)
    ],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_a_bad_model_is_one_line_in_every_command(tmp_path, capsys, name, case):
    """A file that is not a GGUF, a directory that is not a Llama, a file given for a model
    directory: one line, exit code 2, in decode, serve and convert (nothing written)."""
    from ladder_jax.cli import serve

    argv, needle = case(tmp_path)
    if name == "convert":
        argv = [*argv, "--out", str(tmp_path / "out")]
    main = {"decode": decode_cli.main, "serve": serve.main, "convert": convert.main}[name]
    line = one_line(capsys, main(argv))
    assert needle in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["decode_matmul", "calibrate_gpu"])
def test_gpu_benchmarks_without_a_gpu_are_one_line(tmp_path, script):
    """benchmarks/decode_matmul.py and calibrate_gpu.py on a host without a GPU (and without
    --dry-run): one line, exit code 2, nothing written."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", f"{script}.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 2 and not r.stdout, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.strip() == (
        "error: no GPU here: run on a GPU, or pass --dry-run to check the script on CPU"
    ), r.stderr
    assert not out.exists()


def test_gpu_check_dry_run_runs_every_check_on_the_cpu():
    """benchmarks/gpu_check.py --dry-run (CPU against CPU) runs every check to a PASS: the
    script a lent GPU runs first works end to end before any GPU is lent."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "gpu_check.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    lines = [x for x in r.stdout.splitlines() if x.split(" ")[0] in ("PASS", "FAIL", "ERROR")]
    assert r.returncode == 0 and len(lines) >= 10, (r.returncode, r.stdout, r.stderr[-2000:])
    assert all(x.startswith("PASS") for x in lines), r.stdout
    assert f"gpu_check: {len(lines)}/{len(lines)} passed" in r.stdout
