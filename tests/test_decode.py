"""KV-cached decoding against full forwards, batching, sampling, multi-process, bad input."""

import math
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import ladder_jax as lj
from ladder_jax.inference import generation
from ladder_jax.inference.cache import KVCache
from ladder_jax.model import sharding
from tests import helpers
from tests.helpers import SCHEMES, free_port, run_module
from tests.helpers import logits as _logits
from tests.helpers import tiny_model as _model


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_greedy_cached_decoding_equals_full_forward(scheme, tp):
    """Token n of cached greedy decoding == argmax of a full (uncached) forward over the
    prompt and tokens < n: checked at once on the final sequence, which is causal."""
    model = _model(tp, **SCHEMES[scheme])
    prompts = [[5, 17, 99, 3, 250, 7, 8], [11, 12]]
    n_new = 12
    out = generation.generate(model, prompts, max_new_tokens=n_new)
    for prompt, new in zip(prompts, out):
        assert len(new) == n_new
        seq = np.array([prompt + new], np.int32)
        full = np.asarray(_logits(model, seq))[0]
        want = full[len(prompt) - 1 : len(prompt) - 1 + n_new].argmax(-1)
        np.testing.assert_array_equal(np.array(new), want)


def test_batch_of_different_lengths_equals_each_prompt_alone():
    model = _model(4, residual="ladder")
    prompts = [[1, 2, 3], list(range(40, 70)), [9], [200, 100, 50, 25, 12]]
    together = generation.generate(model, prompts, max_new_tokens=10)
    alone = [generation.generate(model, [p], max_new_tokens=10)[0] for p in prompts]
    assert together == alone
    assert len({tuple(x) for x in together}) > 1  # not trivially identical rows


def test_sampling_top_k1_seeds_and_eos():
    model = _model(2, residual="ladder")
    prompt = [[10, 20, 30]]
    greedy = generation.generate(model, prompt, max_new_tokens=16)
    assert generation.generate(model, prompt, max_new_tokens=16, temperature=1.0, top_k=1) == greedy
    a = generation.generate(model, prompt, max_new_tokens=16, temperature=1.0, seed=1)
    b = generation.generate(model, prompt, max_new_tokens=16, temperature=1.0, seed=1)
    c = generation.generate(model, prompt, max_new_tokens=16, temperature=1.0, seed=2)
    assert a == b and a != c
    nucleus = generation.generate(
        model, prompt, max_new_tokens=16, temperature=1.0, top_p=0.5, seed=1
    )
    assert nucleus != a  # top_p changes the distribution
    # a row stops at its EOS; the first greedy token used as EOS ends it at once
    assert generation.generate(model, prompt, max_new_tokens=16, eos_id=greedy[0][0]) == [[]]
    assert generation.generate(model, prompt, max_new_tokens=16, eos_id=greedy[0][3]) == [
        greedy[0][:3]
    ]


def test_sampled_rows_do_not_depend_on_the_batch_and_sampling_objects_equal_keywords():
    """Row b draws with fold_in(key(seed), b): row 0 of a batch samples like the prompt alone
    (the old shared-key sampler drew every row from one (B, V) draw, so it would not)."""
    model = _model(1, residual="ladder")
    s = generation.Sampling(temperature=1.0, top_k=40, seed=5)
    alone = generation.generate(model, [[10, 20, 30]], max_new_tokens=8, sampling=s)
    batch = generation.generate(model, [[10, 20, 30], [7] * 9, [1]], max_new_tokens=8, sampling=s)
    assert batch[0] == alone[0]
    assert (
        generation.generate(
            model, [[10, 20, 30]], max_new_tokens=8, temperature=1.0, top_k=40, seed=5
        )
        == alone
    )
    with pytest.raises(generation.GenerationError, match="not both"):
        generation.generate(model, [[1]], sampling=s, temperature=0.5)


@pytest.mark.parametrize("seed", ["x", 1.5, True, -1, 2**32])
def test_bad_seed_is_one_usage_error(seed):
    with pytest.raises(lj.UsageError, match=r"seed=.* must be an integer from 0 to 2\*\*32"):
        lj.generate(_model(1), [[1, 2]], max_new_tokens=2, seed=seed)


def test_kv_cache_is_a_typed_pytree_with_its_shardings():
    model = _model(4)
    c = model.config
    abstract = KVCache.abstract(c, model.mesh, batch=2, length=64)
    cache = KVCache.init(c, model.mesh, batch=2, length=64)
    kv_heads = max(c.n_kv_heads, 4)  # K' = max(K, tp)
    assert (cache.batch, cache.length) == (2, 64)
    assert len(jax.tree.leaves(cache)) == 2 * c.n_layers
    shapes = {"k": (2, kv_heads, c.head_dim, 64), "v": (2, kv_heads, 64, c.head_dim)}
    for name in ("k", "v"):  # keys (B, K', H, S), values (B, K', S, H)
        for a, x in zip(getattr(abstract, name), getattr(cache, name)):
            assert a.shape == x.shape == shapes[name] and a.dtype == x.dtype
            assert x.sharding == a.sharding == NamedSharding(model.mesh, sharding.CACHE_BKSH)
    want = 2 * c.n_layers * 2 * 64 * kv_heads * c.head_dim * np.dtype(c.dtype).itemsize
    assert abstract.nbytes == cache.nbytes == want
    doubled = jax.jit(lambda kv: jax.tree.map(lambda x: x + 1, kv))(cache)
    assert isinstance(doubled, KVCache) and float(doubled.k[0][0, 0, 0, 0]) == 1.0


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    keys = [jax.random.key(i) for i in range(200)]
    top_p = generation.Sampling(1.0, None, 0.75)
    seen = {int(generation.sample(logits, k, top_p)[0]) for k in keys}
    assert seen == {0, 1}  # 0.5 < 0.75 <= 0.8: the first two tokens
    seen = {int(generation.sample(logits, k, generation.Sampling(1.0, None, 0.5))[0]) for k in keys}
    assert seen == {0}


def test_strings_stream_and_text():
    model = _model(2)
    streamed = []
    out = generation.generate(
        model, ["Hi", "Hello"], max_new_tokens=5, stream=lambda t, toks: streamed.append(toks)
    )
    assert all(isinstance(s, str) for s in out)
    assert len(streamed) == 5 and all(len(s) == 2 for s in streamed)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(prompts=[list(range(300))]),
            r"prompt 0 has 300 tokens, but the cache holds "
            r"max_seq_len=256",
        ),
        (dict(prompts=[list(range(200))], max_new_tokens=100), r"300 positions.*<= 156 tokens"),
        (dict(prompts=[[]]), "prompt 0 is empty"),
        (dict(prompts=[[1, 2]], top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(prompts=[[1, 2]], top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(prompts=[[1, 2]], temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (dict(prompts=[[1, 400]]), r"outside \[0, 320\)"),
        (dict(prompts=[]), "no prompts"),
    ],
)
def test_bad_input_is_refused_before_device_work(kwargs, match):
    model = _model(1)
    kwargs.setdefault("max_new_tokens", 8)
    with pytest.raises(generation.GenerationError, match=match):
        generation.generate(model, **kwargs)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--prompt", "x" * 300], "has 301 tokens"),
        (["--prompt", ""], "prompt 0 is empty"),
        (["--prompt", "x", "--top-p", "2"], "top_p=2.0 must be in"),
        (["--prompt", "x", "--temperature", "-0.5"], "temperature=-0.5 must be >= 0"),
        (["--preset", "llama-3-9b"], "did you mean 'llama-3-8b'"),
    ],
)
def test_cli_bad_input_exits_cleanly(args, match):
    r = run_module("decode", *args)
    assert r.returncode == 2, r.stderr
    assert match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_prints_what_generate_samples_with_its_sampling(capsys):
    """decode's text, one prompt (streamed) and two, equals `generate` with the Sampling of
    its flags (sampled, top_k, seed) on the same random weights."""
    from ladder_jax.cli import decode as decode_cli

    sampling = generation.Sampling(0.9, 50, None, 3)
    want = generation.generate(
        _model(1, seed=3), ["Once", "LOVE, n."], max_new_tokens=8, sampling=sampling
    )
    argv = [
        "--tp",
        "1",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--seed",
        "3",
        "--prompt",
        "Once",
    ]
    assert decode_cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == f"{want[0]}\n" and "Transformer(" in err  # stdout: the new text alone
    assert "\nOnce\n" in err  # the prompt, for the eye, on stderr
    assert decode_cli.main(argv + ["--prompt", "LOVE, n."]) == 0
    assert capsys.readouterr().out == (
        f"--- 'Once'\nOnce{want[0]}\n--- 'LOVE, n.'\nLOVE, n.{want[1]}\n"
    )


def test_cli_streams_text():
    r = run_module("decode", "--prompt", "Hello", "--max-new-tokens", "6", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n"), r.stdout  # the answer (test above: exactly the new text)
    assert "\nHello\n" in r.stderr and "Transformer(" in r.stderr, r.stderr


_WORKER = textwrap.dedent("""
    import json, sys
    import jax
    pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    jax.config.update("jax_num_cpu_devices", 2)
    from flax import nnx
    import ladder_jax as lj
    from ladder_jax.cli import decode as decode_cli
    from ladder_jax.inference import generation
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = lj.make_mesh(tp=4)  # tensor parallelism across both processes
    model = lj.Transformer(lj.ModelConfig.from_preset("tiny", residual="ladder"), mesh=mesh,
                           rngs=nnx.Rngs(0))
    tokens = generation.generate(model, [[5, 6, 7], [1, 2, 3, 4, 5, 6]], max_new_tokens=10)
    if pid == 0:
        json.dump(tokens, open(out, "w"))
""")


def test_two_processes_with_tp_across_them_match_one_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    out = tmp_path / "tokens.json"
    port = str(free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), port, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    import json

    got = json.loads(out.read_text())
    model = _model(1, residual="ladder")
    assert got == generation.generate(model, [[5, 6, 7], [1, 2, 3, 4, 5, 6]], max_new_tokens=10)


def _cache_sized(hlo: str, elements: int) -> list:
    """(name, op) of every instruction in `hlo`, fused or not, whose result holds `elements`
    values (a whole per-rank cache array)."""
    found = []
    for m in re.finditer(r"%(\S+) = \w+\[([\d,]*)\]\S* (\w[\w-]*)\(", hlo):
        name, dims, op = m.groups()
        if math.prod(int(d) for d in dims.split(",") if d) == elements:
            found.append((name, op))
    return found


@pytest.mark.parametrize("target", ["cpu", "h100"])
def test_decode_step_reads_the_cache_where_it_lies(target):
    """The decode step's attention reads keys (B, K, H, S) and values (B, K, S, H) in place:
    no transpose or copy of a whole cache array in the compiled program, on CPU (tp 1: four
    kv heads on the rank) and in the deviceless H100 program at tp 2 (two per rank). With the
    cache stored (B, S, K, H), both programs copied every layer's keys and values into head
    order (and the GPU one back) on every step."""
    from ladder_jax.analysis import programs

    config = lj.ModelConfig.from_preset("tiny")
    B, H = 8, config.head_dim
    if target == "cpu":
        mesh = helpers.mesh(1)
        decoder = generation.Decoder(lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)))
        S, heads = 64, config.n_kv_heads
        ints = jax.ShapeDtypeStruct((B,), np.int32)
        rows = generation.rows_to_device(
            generation.RowSampling.of([generation.Sampling()] * B), mesh
        )
        hlo = (
            decoder.lower_decode(KVCache.abstract(config, mesh, B, S), ints, ints, rows, ints)
            .compile()
            .as_text()
        )
    else:
        hlo = programs.compile_program(
            config, phase="decode", tp=2, batch=B, seq=32, new_tokens=32, cache=False
        )[0]
        S, heads = generation.cache_length(config, 32, 32), config.n_kv_heads // 2
    sized = _cache_sized(hlo, B * heads * S * H)
    assert sized  # the cache's own arrays (parameters, its in-place update) are read
    copies = [(n, op) for n, op in sized if op in ("transpose", "copy") or "transpose" in n]
    assert copies == []


def test_decoder_fuses_its_projections_only_where_the_copy_fits(monkeypatch):
    """The fused q/k/v and gate/up are a copy beside the model's weights: made when it fits
    (`generation.fusion_fits`), skipped with one warning where it would take over half the
    free memory, and the unfused decoder draws the same tokens."""
    model = _model(2, residual="ladder")
    fused = generation.Decoder(model)
    assert fused.fused and fused.state["layers"][0]["attn"]["qkv"] is not None
    prompts = [[1, 2, 3, 4], [5, 6]]
    want = generation.generate(model, prompts, max_new_tokens=6, decoder=fused)
    need = sum(
        sh.data.nbytes
        for layer in model.layers
        for w in (layer.attn.q, layer.attn.k, layer.attn.v, layer.mlp.gate, layer.mlp.up)
        for sh in w.weight.get_value().addressable_shards
    )
    monkeypatch.setattr(generation.runtime, "available_memory", lambda: int(1.9 * need))
    with pytest.warns(UserWarning, match="decoding without fused input projections"):
        plain = generation.Decoder(model)
    assert not plain.fused and "qkv" not in plain.state["layers"][0]["attn"]
    assert generation.generate(model, prompts, max_new_tokens=6, decoder=plain) == want
    monkeypatch.setattr(generation.runtime, "available_memory", lambda: int(2.1 * need))
    assert generation.Decoder(model).fused


def test_a_consuming_decoder_fuses_in_place_layer_by_layer(monkeypatch):
    """`Decoder(model, consume=True)` (what `decode` and `serve` use) fuses even where the copy
    would not fit beside the model, freeing each layer's separate projections before the next
    layer is fused (the peak is one layer's copy), and draws the tokens of a decoder over an
    untouched copy of the model."""
    from ladder_jax.model import transformer

    prompts = [[1, 2, 3, 4], [5, 6]]
    want = generation.generate(_model(2, residual="ladder"), prompts, max_new_tokens=6)
    model = _model(2, residual="ladder")
    monkeypatch.setattr(generation.runtime, "available_memory", lambda: 1)  # no room for a copy
    real_fuse, seen = transformer._fuse, []

    def fuse(m, weights, kv):
        seen.append(
            [
                w.weight.get_value().is_deleted()
                for layer in model.layers
                for w in (layer.attn.q, layer.mlp.up)
            ]
        )
        return real_fuse(m, weights, kv)

    monkeypatch.setattr(transformer, "_fuse", fuse)
    decoder = generation.Decoder(model, consume=True)
    n = model.config.n_layers
    assert decoder.fused and len(seen) == 2 * n  # qkv and gate_up of every layer
    for i in range(n):  # before layer i's fusions: layers < i freed, the rest still there
        assert seen[2 * i] == [j < i for j in range(n) for _ in range(2)]
    assert all(
        w.weight.get_value().is_deleted()
        for layer in model.layers
        for w in (layer.attn.q, layer.attn.k, layer.attn.v, layer.mlp.gate, layer.mlp.up)
    )
    assert not model.layers[0].attn.o.weight.get_value().is_deleted()  # shared with the decoder
    assert generation.generate(model, prompts, max_new_tokens=6, decoder=decoder) == want


def test_a_second_generate_compiles_nothing():
    """Every `generate` call builds a Decoder; Decoders of equal models share their jitted
    programs (`generation._programs`) and the fusing concatenations, so a second call, even on
    a second model object of the same config, compiles nothing (before, each call compiled
    the prefill, the step and the fusions again: ~3.5 s per call of the `small` preset)."""
    compiles = []

    def listener(name, secs, **kw):
        if name.endswith("backend_compile_duration"):
            compiles.append(name)

    first = generation.generate(_model(2, residual="ladder"), [[1, 2, 3]], max_new_tokens=4)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        again = generation.generate(_model(2, residual="ladder"), [[1, 2, 3]], max_new_tokens=4)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [] and again == first


# ---------------------------------------------------------------------------------------------
# The tp decode and serve choose when not told, and the flag their refusals name.


def _save_hf(path, **shape):
    config = lj.ModelConfig.from_preset("tiny", n_layers=1, **shape)
    mesh = sharding.make_mesh(tp=1, devices=jax.devices()[:1])
    lj.save_hf(lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)), path)
    return str(path)


_SHAPES = {  # heads the 8 fake devices do not divide; by hand, the largest tp that fits
    "4 heads": (dict(n_heads=4, n_kv_heads=2), {2: 1, 8: 4, 16: 4}),
    "9 heads": (
        dict(n_heads=9, n_kv_heads=9, d_model=72, d_ff=144, vocab_size=300),
        {2: 1, 8: 3, 16: 3},
    ),
}


@pytest.mark.parametrize("cores", [2, 8])
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_decode_without_tp_picks_the_largest_that_fits_heads_and_cores(
    tmp_path, capsys, monkeypatch, shape, cores
):
    """A model whose heads the devices' count does not divide decodes without --tp, at the
    largest tp that divides its heads within half the host's cores, said in one stderr line;
    its greedy text is --tp 1's."""
    from ladder_jax import runtime
    from ladder_jax.cli import decode as decode_cli

    fields, want = _SHAPES[shape]
    path = _save_hf(tmp_path / "hf", **fields)
    monkeypatch.setattr(runtime, "cpu_cores", lambda: cores)
    argv = ["--checkpoint", path, "--max-new-tokens", "6", "--temperature", "0"]
    assert decode_cli.main(argv) == 0
    out, err = capsys.readouterr()
    tp = want[cores]
    notes = [ln for ln in err.splitlines() if ln.startswith("note: tp=")]
    assert len(notes) == 1 and notes[0].startswith(f"note: tp={tp}: "), err
    assert f"half this host's {cores} CPU core(s)" in notes[0] and "--tp" in notes[0], notes
    assert f"x tp:{tp})" in err, err
    assert decode_cli.main(argv + ["--tp", "1"]) == 0
    assert capsys.readouterr().out == out


def test_a_tp_below_the_devices_runs_on_that_many_and_decodes_as_tp_1(tmp_path, capsys):
    """--tp 2 on the 8 fake devices: a (data 1, tp 2) mesh of two devices, not the other six
    as data-parallel copies; one stderr note says they are unused; greedy text is --tp 1's.
    `lj.load(tp=2)` makes the same mesh."""
    from ladder_jax.cli import decode as decode_cli

    path = _save_hf(tmp_path / "hf")
    argv = ["--checkpoint", path, "--max-new-tokens", "8", "--temperature", "0"]
    argv += ["--prompt", "LOVE, n.", "--prompt", "ab"]
    assert decode_cli.main(argv + ["--tp", "2"]) == 0
    out2, err = capsys.readouterr()
    assert "mesh=data:1 x tp:2)" in err, err
    notes = [ln for ln in err.splitlines() if "unused" in ln]
    assert notes == ["note: --tp 2 runs on 2 of the 8 devices; the other 6 are unused"], err
    assert decode_cli.main(argv + ["--tp", "1"]) == 0
    out1, err = capsys.readouterr()
    assert "mesh=data:1 x tp:1)" in err, err
    assert [ln for ln in err.splitlines() if "unused" in ln] == [
        "note: --tp 1 runs on 1 of the 8 devices; the other 7 are unused"
    ], err
    assert out2 == out1 and len(out1.splitlines()) > 2, out1
    model, _ = lj.load(path, tp=2)
    assert model.mesh.devices.tolist() == [jax.devices()[:2]]
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if "unused" in ln] == [
        "note: tp 2 runs on 2 of the 8 devices; the other 6 are unused"
    ], err


def test_a_tp_the_heads_do_not_divide_names_the_flag(tmp_path, capsys):
    from ladder_jax.cli import decode as decode_cli
    from ladder_jax.cli import serve as serve_cli

    path = _save_hf(tmp_path / "hf", n_heads=4, n_kv_heads=2)
    for main in (decode_cli.main, serve_cli.main):
        rc = main(["--checkpoint", path, "--tp", "3"])
        out, err = capsys.readouterr()
        assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: n_heads=4 is not divisible by tp=3") and (
            "(set by --tp; e.g. --tp 2)" in err
        ), err
        rc = main(["--checkpoint", path, "--tp", "8"])
        out, err = capsys.readouterr()
        assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "--tp 8: the model has 4 query heads" in err and "at most 4" in err, err
    with pytest.raises(lj.ShardingError, match=r"tp=3: .*set by mesh\.tp; e\.g\. mesh\.tp=2"):
        sharding.check_divisible(lj.ModelConfig.from_preset("tiny"), 3, flag="mesh.tp")
