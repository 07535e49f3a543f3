"""End-to-end training: learning, resume bit for bit, mesh and process invariance, faults,
config errors. Small on purpose: 2-layer tiny model, 32-token sequences, a few steps."""

import contextlib
import functools
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

import ladder_jax as lj
from ladder_jax import train_config
from ladder_jax.config import ModelConfig
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.model.transformer import Transformer
from ladder_jax.train import checkpoint, data, step, trainer
from ladder_jax.train.rundir import RunDir, changed_keys
from tests import helpers
from tests.helpers import free_port, last_step, train_process

SMALL = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.batch_size=8",
    "eval_batches=2",
    "progress=lines",
    "log_every=1000",
    "optim.warmup_steps=5",
    "optim.peak_lr=3e-3",
    "mesh.data=1",
]


def config(tmp_path, *overrides, name="run"):
    return train_config.load_config(SMALL + [f"run_dir={tmp_path}", f"name={name}", *overrides])


def metrics(tmp_path, name="run"):
    with open(tmp_path / name / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_loss_falls_on_embedded_corpus(tmp_path, capsys):
    out = trainer.run(config(tmp_path, "steps=40", "eval_every=0"))
    # the last line gives the process's peak memory, as getrusage reports it
    done = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("done:")]
    assert len(done) == 1 and f"peak memory {out['peak_rss'] / 1e9:.2f} GB RSS" in done[0], done
    with open("/proc/meminfo") as f:
        total = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) * 1024
    assert 50e6 < out["peak_rss"] < total  # more than jax itself holds, less than the machine
    assert out["peak_device"] is None  # XLA:CPU keeps no pool statistics
    losses = [out["losses"][s] for s in sorted(out["losses"])]
    assert losses[0] > 5.0  # ~ln(320) at init
    assert np.mean(losses[-5:]) < losses[0] - 2.0, losses
    assert out["eval_loss"] < 3.5
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["eval_ppl"] == pytest.approx(np.exp(rows[-1]["eval_loss"]))


@pytest.fixture(scope="module")
def tp1_losses(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp1")
    return trainer.run(config(path, "steps=4", "eval_every=0", name="ref"))["losses"]


@pytest.mark.parametrize(
    "mesh",
    [
        ("mesh.tp=2", "mesh.data=1"),
        ("mesh.tp=1", "mesh.data=2"),
        ("mesh.tp=2", "mesh.data=2"),
        ("mesh.tp=2", "mesh.data=2", "mesh.fsdp=true"),
        ("mesh.tp=2", "mesh.data=2", "loss_chunk=12"),
    ],
)
def test_mesh_gives_same_losses(tmp_path, mesh, tp1_losses):
    ref = tp1_losses
    got = trainer.run(config(tmp_path, "steps=4", "eval_every=0", *mesh))["losses"]
    assert list(got) == list(ref) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in got], [ref[s] for s in ref], rtol=2e-5)


@pytest.mark.parametrize(
    "tie,chunk,masked,tp,data", [(True, 12, True, 2, 2), (False, 8, False, 1, 1)]
)
def test_chunked_cross_entropy_equals_the_plain_formula(tie, chunk, masked, tp, data):
    """The chunked loss against log-softmax over the whole logits of the full forward: the
    loss and every gradient, tied and untied heads, a chunk that does not divide T (padded),
    a mask, a sharded mesh."""
    cfg = ModelConfig.from_preset("tiny", n_layers=2, tie_embeddings=tie)
    graphdef, params = nnx.split(Transformer(cfg, mesh=helpers.mesh(tp, data), rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(5), (4, 33), 0, cfg.vocab_size)
    mask = (jax.random.uniform(jax.random.key(6), (4, 32)) > 0.3).astype(jnp.float32)
    mask = mask if masked else jnp.ones((4, 32))

    def plain(p):
        logp_btv = jax.nn.log_softmax(nnx.merge(graphdef, p)(tokens[:, :-1]), axis=-1)
        nll_bt = -jnp.take_along_axis(logp_btv, tokens[:, 1:, None], axis=-1)[..., 0]
        return (nll_bt * mask).sum() / mask.sum()

    def chunked(p):
        m = mask if masked else None
        return step.loss_fn(graphdef, p, tokens[:, :-1], tokens[:, 1:], m, loss_chunk=chunk)

    (want, want_g), (got, got_g) = [
        jax.jit(jax.value_and_grad(f))(params) for f in (plain, chunked)
    ]
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    want_g, got_g = (nnx.to_pure_dict(g) for g in (want_g, got_g))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), got_g, want_g)
    norm = lambda g: float(optax.tree.norm(g))  # noqa: E731
    assert norm(got_g) == pytest.approx(norm(want_g), rel=1e-5) and norm(want_g) > 0


def test_grad_accumulation_equals_big_batch(tmp_path):
    big = trainer.run(config(tmp_path, "steps=3", "data.batch_size=8", name="big"))
    acc = trainer.run(config(tmp_path, "steps=3", "data.batch_size=4", "data.grad_accum=2"))
    # Same records (the iterator's batch is batch_size x grad_accum), same mean gradient.
    np.testing.assert_allclose(
        list(acc["losses"].values()), list(big["losses"].values()), rtol=2e-5
    )


def test_sigterm_then_rerun_equals_uninterrupted(tmp_path):
    args = SMALL + ["steps=300", "ckpt_every=100", "eval_every=0", f"run_dir={tmp_path}"]
    proc = train_process(*args, "name=cut")
    deadline = time.time() + 900
    while last_step(tmp_path / "cut") < 120:  # the state it needs: mid-run, past step 120
        assert time.time() < deadline, "step 120 not reached in 900 s"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    cut = metrics(tmp_path, "cut")[-1]["step"]
    assert 120 <= cut < 300, "the run should have been interrupted mid-way"
    assert f"checkpoint saved at step {cut}" in err + _
    proc = train_process(*args, "name=cut")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resumed from" in out and f"/{cut} " in out
    resumed = metrics(tmp_path, "cut")
    ref = trainer.run(config(tmp_path, "steps=300", "ckpt_every=100", "eval_every=0", name="ref"))
    ref_rows = metrics(tmp_path, "ref")
    assert [r["step"] for r in resumed] == list(range(1, 301))
    # the data iterator neither repeated nor skipped a batch...
    assert [r["batch_crc"] for r in resumed] == [r["batch_crc"] for r in ref_rows]
    # ...and the losses are bit for bit those of the uninterrupted run
    assert [r["loss"] for r in resumed] == [ref["losses"][s] for s in range(1, 301)]


def test_resume_on_another_mesh_and_init_from(tmp_path):
    base = ("eval_every=0", "ckpt_every=3")
    a = trainer.run(config(tmp_path, "steps=5", "mesh.tp=2", "mesh.data=1", *base, name="ref"))
    trainer.run(config(tmp_path, "steps=3", "mesh.tp=2", "mesh.data=1", *base))
    # same run directory, more steps, tp 2 -> 4: resumes from step 3 on the new mesh
    b = trainer.run(config(tmp_path, "steps=5", "mesh.tp=4", "mesh.data=1", *base))
    np.testing.assert_allclose(
        [b["losses"][s] for s in (4, 5)], [a["losses"][s] for s in (4, 5)], rtol=2e-5
    )
    # weights only: step 1 of a new run evaluates the loaded weights
    c = trainer.run(config(tmp_path, "steps=1", f"init_from={tmp_path}/ref", *base, name="ft"))
    assert c["losses"][1] < a["losses"][1] - 0.5


def test_desync_resume_is_bit_exact_and_records_its_streams(tmp_path):
    """A desync model (every_2_layers, desync_tp from the mesh: 2) trained 4 steps straight,
    and 2 steps then resumed to 4: the same losses bit for bit; config.yaml records
    desync_tp, so the same run resumed on tp 1 carries the 2 streams (losses to rounding)."""
    scheme = ("model.residual=desync", "model.reduce_pattern=every_2_layers", "eval_every=0")
    base = (*scheme, "ckpt_every=2", "mesh.tp=2", "mesh.data=1")
    a = trainer.run(config(tmp_path, "steps=4", *base, name="ref"))
    trainer.run(config(tmp_path, "steps=2", *base))
    b = trainer.run(config(tmp_path, "steps=4", *base))
    assert [b["losses"][s] for s in (3, 4)] == [a["losses"][s] for s in (3, 4)]
    assert "desync_tp: 2" in (tmp_path / "run" / "config.yaml").read_text()
    trainer.run(config(tmp_path, "steps=2", *base, name="moved"))
    c = trainer.run(
        config(
            tmp_path,
            "steps=4",
            *scheme,
            "ckpt_every=2",
            "mesh.tp=1",
            "model.desync_tp=2",
            name="moved",
        )
    )
    np.testing.assert_allclose(
        [c["losses"][s] for s in (3, 4)], [a["losses"][s] for s in (3, 4)], rtol=2e-5
    )


def _leaves(tree) -> dict:
    """{"layers/0/attn/q/weight": numpy array} of a tree of weights (list indices as text, as
    orbax restores them)."""
    return {
        "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path): np.asarray(v)
        for path, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def test_init_from_loads_into_shapes_and_reports_to_a_callers_stderr(tmp_path, monkeypatch, capsys):
    """As ladder_jax.experiments.adaptation trains: in-process, stdout sent to stderr, weights
    from init_from, no held-out data. No random model is made, step 1 (learning rate 0)
    keeps exactly the loaded weights, and the `done:` line (peak memory) reaches stderr."""
    ft = config(
        tmp_path,
        "steps=1",
        "seed=7",
        "eval_every=0",
        "data.eval_fraction=0.0",
        "progress=none",
        f"init_from={tmp_path}/src",
        name="ft",
    )
    source = Transformer(train_config.model_config(ft), mesh=helpers.mesh(1), rngs=nnx.Rngs(3))
    weights = _leaves(nnx.to_pure_dict(nnx.state(source)))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "src" / "params", nnx.to_pure_dict(nnx.state(source)))

    def no_random_model(*args, **kwargs):
        raise AssertionError("init_from: a randomly initialized model was built")

    monkeypatch.setattr(trainer, "Transformer", no_random_model)
    with contextlib.redirect_stdout(sys.stderr):
        out = trainer.run(ft)
    with ocp.StandardCheckpointer() as ckptr:
        got = _leaves(ckptr.restore(tmp_path / "ft" / "checkpoints" / "1" / "params"))
    assert got.keys() == weights.keys() and len(got) > 10
    for k in weights:
        np.testing.assert_array_equal(got[k], weights[k], err_msg=k)
    captured = capsys.readouterr()
    done = [ln for ln in captured.err.splitlines() if ln.startswith("done:")]
    assert len(done) == 1 and "held-out" not in done[0], captured.err
    assert f"peak memory {out['peak_rss'] / 1e9:.2f} GB RSS" in done[0]
    assert "done:" not in captured.out


def _tokenizer_json(path) -> list[str]:
    """A word-level tokenizer.json at `path`; returns its words (ids in order)."""
    words = ["<unk>", "<s>", "</s>", "the", "a", "of"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.add_special_tokens(words[:3])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(str(path))
    return words


def test_a_run_with_a_tokenizer_loads_after_mv(tmp_path, monkeypatch):
    """config.yaml stores data.tokenizer so that the run directory can be moved: given relative
    to the working directory it is stored absolute; inside the run, relative to the run."""
    _tokenizer_json(tmp_path / "work" / "tok" / "tokenizer.json")
    monkeypatch.chdir(tmp_path / "work")
    args = ["run_dir=runs", "steps=1", "eval_every=0", "data.eval_fraction=0.0"]
    trainer.run(
        train_config.load_config(SMALL + args + ["name=r", "data.tokenizer=tok/tokenizer.json"])
    )
    os.rename(tmp_path / "work" / "runs" / "r", tmp_path / "moved")
    monkeypatch.chdir(tmp_path)  # decode / eval from elsewhere
    model, tok = lj.load(str(tmp_path / "moved"), tp=1)
    assert tok.encode("the a of nothing") == [3, 4, 5, 0]
    assert model.config.n_layers == 2
    # a resume in the same place reads config.yaml's spelling of the same file: no change
    monkeypatch.chdir(tmp_path / "work")
    absolute = {"data": {"tokenizer": str(tmp_path / "work" / "tok" / "tokenizer.json")}}
    assert changed_keys({"data": {"tokenizer": "tok/tokenizer.json"}}, absolute) == {}
    # a tokenizer inside the run directory moves with it
    _tokenizer_json(tmp_path / "work" / "runs" / "in" / "assets" / "t.json")
    cfg = train_config.load_config(
        SMALL + args + ["name=in", "data.tokenizer=runs/in/assets/t.json"]
    )
    RunDir(cfg, print).open_files(0, {})[1].close()
    with open(tmp_path / "work" / "runs" / "in" / "config.yaml") as f:
        assert yaml.safe_load(f)["data"]["tokenizer"] == os.path.join("assets", "t.json")
    os.rename(tmp_path / "work" / "runs" / "in", tmp_path / "in2")
    monkeypatch.chdir(tmp_path)
    moved = train_config.load_config([str(tmp_path / "in2" / "config.yaml")])
    assert moved.data.tokenizer == str(tmp_path / "in2" / "assets" / "t.json")


def test_nonfinite_gradient_is_skipped_and_params_unchanged():
    mesh = helpers.mesh(2)
    cfg = ModelConfig.from_preset("tiny", n_layers=2)
    graphdef, params = nnx.split(Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    optimizer = step.make_optimizer()
    opt_state = optimizer.init(params)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    shardings = step.shardings_of(params)
    fn = jax.jit(
        lambda p, o, t, m: step.train_step(
            graphdef, p, o, t, t, optimizer=optimizer, shardings=shardings, mask_bt=m
        )
    )
    before = jax.tree.map(np.asarray, (params, opt_state))
    nan_mask = jnp.full(tokens.shape, jnp.nan)  # poisons the loss and every gradient
    p2, o2, m = fn(params, opt_state, tokens, nan_mask)
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (p2, o2)), before)
    p3, o3, m = fn(p2, o2, tokens, jnp.ones(tokens.shape))  # learning rate 0 at step 0
    # a finite step is optax's own clipping and AdamW update, applied as given
    _, grads = step.loss_and_grads(graphdef, p3, tokens, tokens, jnp.ones(tokens.shape))
    clip = optax.clip_by_global_norm(1.0)
    grads, _ = clip.update(grads, clip.init(p3))
    updates, o_ref = optimizer.update(grads, o3, p3)
    p_ref = optax.apply_updates(p3, updates)
    p3, o4, m = fn(p3, o3, tokens, jnp.ones(tokens.shape))
    assert int(m["skipped"]) == 0
    assert not np.array_equal(np.asarray(p3["embed"][...]), before[0]["embed"][...])
    check = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
    as_np = functools.partial(jax.tree.map, np.asarray)
    jax.tree.map(check, as_np((p3, o4)), as_np((p_ref, o_ref)))


def test_too_many_nonfinite_steps_stop_with_last_checkpoint_intact(tmp_path):
    # An absurd learning rate blows the weights up at step 1; every later loss is non-finite.
    cfg = config(
        tmp_path,
        "steps=20",
        "optim.peak_lr=1e30",
        "optim.warmup_steps=1",
        "ckpt_every=1",
        "max_bad_steps=3",
        "eval_every=0",
    )
    with pytest.raises(trainer.NonFiniteError, match="3 non-finite steps in a row"):
        trainer.run(cfg)
    rows = metrics(tmp_path)
    assert [r.get("skipped", False) for r in rows][-3:] == [True] * 3
    ckpts = checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints"))
    last = ckpts.latest_step()
    assert last is not None and last < rows[-1]["step"]
    ckpts.close()


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["optim.peak_lrr=1e-3"],
            "unknown config key 'optim.peak_lrr' (did you mean 'optim.peak_lr'?)",
        ),
        (["stepz=10"], "did you mean 'steps'?"),
        (["steps=many"], "config key 'steps' must be int, got 'many'"),
        (
            ["mesh.tp=1", "mesh.data=2", "data.batch_size=3"],
            "batch size 3 is not divisible by the data axis (2)",
        ),
        (
            ["mesh.tp=3", "mesh.data=1"],
            "n_heads=8 is not divisible by tp=3: use a tp that divides 8 "
            "(set by mesh.tp; e.g. mesh.tp=2)",
        ),
        (["loss_chunk=-8"], "loss_chunk=-8 must be >= 0"),
    ],
)
def test_bad_config_is_a_clear_error(args, message):
    proc = train_process(*args, "steps=1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert message in err
    assert "Traceback" not in err


def test_two_processes_equal_one(tmp_path):
    common = SMALL + ["steps=3", "eval_every=0", "mesh.tp=2", "mesh.data=2"]
    ref = trainer.run(train_config.load_config(common + [f"run_dir={tmp_path}", "name=one"]))[
        "losses"
    ]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        train_process(
            *common,
            f"run_dir={tmp_path}",
            "name=two",
            "mesh.cpu_devices=2",
            f"dist.coordinator_address=127.0.0.1:{port}",
            "dist.num_processes=2",
            f"dist.process_id={i}",
            env=env,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    # process 0 alone logs; Gloo's connection lines ("[Gloo] Rank 0 is connected to 1 peer
    # ranks...", printed by the library itself) are filtered out where the process starts
    assert not [ln for out, err in outs for ln in (out + err).splitlines() if "Gloo" in ln]
    ours = [out.splitlines() for out, _ in outs]
    assert "on 2 process(es)" in ours[0][0]
    assert not any(w in ln for ln in ours[1] for w in ("process(es)", "step ", "done:")), ours[1]
    got = metrics(tmp_path, "two")
    np.testing.assert_allclose([r["loss"] for r in got], [ref[s] for s in (1, 2, 3)], rtol=2e-5)
    assert len(os.listdir(tmp_path / "two" / "tensorboard")) == 1  # process 0's events only


def test_byte_tokenizer_and_sources(tmp_path):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("de")
    stream = data.load_tokens(str(tmp_path), tok)
    assert stream.tolist() == [256, 97, 98, 99, 257, 256, 100, 101, 257]
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.int32))
    assert data.load_tokens(str(tmp_path / "*.npy"), tok).tolist() == list(range(10))
    train_r, held = data.split(np.arange(101), seq_len=10, eval_fraction=0.2)
    assert (len(train_r), len(held)) == (8, 2)
    assert train_r[1].tolist() == list(range(10, 21)) and held[0].tolist() == list(range(80, 91))
    # two shards of one epoch are disjoint and cover everything
    shards = [data.train_iterator(train_r, batch=2, seed=0, shard=(i, 2)) for i in range(2)]
    seen = [r[0] for it in shards for _ in range(2) for r in next(it)]
    assert sorted(seen) == list(range(0, 80, 10))


@pytest.mark.parametrize("name", ["tiny", "1b", "3b"])
def test_shipped_configs_parse(name):
    cfg = train_config.load_config([f"configs/{name}.yaml"])
    mc = train_config.model_config(cfg)
    assert mc.param_dtype == "float32" and cfg.data.seq_len <= mc.max_seq_len
    if name != "tiny":  # the paper's recipe: ~4M tokens per step, bf16 compute, AdamW
        assert cfg.data.batch_size * cfg.data.grad_accum * cfg.data.seq_len == 4 * 2**20
        assert (mc.dtype, cfg.optim.peak_lr, cfg.optim.b2, cfg.optim.eps) == (
            "bfloat16",
            3e-4,
            0.95,
            1e-10,
        )


def test_tensorboard_scalars_equal_the_jsonl_rows(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer.run(config(tmp_path, "steps=4", "eval_every=2", "tensorboard=true"))
    rows = metrics(tmp_path)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/eval_loss",
        "train/eval_ppl",
        "train/skipped",
    } <= tags, tags
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"):
        got = {e.step: e.value for e in events.Scalars(f"train/{key}")}
        want = {r["step"]: r[key] for r in rows if r.get(key) is not None}
        assert got.keys() == want.keys() and len(want) >= 2, (key, got, want)
        np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-6)
    trainer.run(config(tmp_path, "steps=1", "tensorboard=false", name="off"))
    assert not (tmp_path / "off" / "tensorboard").exists()


def test_fit_keywords_resolve_like_the_command_line():
    from ladder_jax import api

    got = api.fit_config(
        "configs/tiny.yaml",
        model__ladder_layers=[1, 3],
        model__residual="ladder",
        optim__peak_lr=1e-3,
        data__path=None,
        mesh__fsdp=True,
    )
    want = train_config.load_config(
        [
            "configs/tiny.yaml",
            "model.ladder_layers=[1,3]",
            "model.residual=ladder",
            "optim.peak_lr=1e-3",
            "data.path=null",
            "mesh.fsdp=true",
        ]
    )
    assert got == want
    assert train_config.model_config(got).ladder_layers == (1, 3) and got.optim.peak_lr == 1e-3
    with pytest.raises(trainer.ConfigError, match="did you mean 'optim.peak_lr'"):
        api.fit_config("configs/tiny.yaml", optim__peek_lr=1.0)


def test_cpu_hosts_split_the_batch_over_one_device_per_core(tmp_path, monkeypatch):
    """`mesh.data: null` on a CPU host: one fake device per core over tp, lowered to a divisor
    of the batch (`trainer.cpu_data_parallel`); the trainer's mesh takes that many."""
    from ladder_jax import train_config
    from ladder_jax.train import trainer as trainer_module

    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")

    def cfg(*over):
        return train_config.load_config([tiny, f"run_dir={tmp_path}", *over])

    assert cfg().mesh.data is None  # the embedded default leaves it to the host
    for cores, over, want in [
        (2, [], 2),
        (1, [], 1),
        (8, ["mesh.tp=2"], 4),
        (8, ["mesh.tp=2", "data.batch_size=6"], 3),
        (3, ["data.batch_size=16"], 2),
    ]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert trainer_module.cpu_data_parallel(cfg(*over)) == want, (cores, over)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    t = trainer_module.Trainer(cfg("progress=none"))
    assert dict(t.mesh.shape) == {"data": 2, "tp": 1}
    t = trainer_module.Trainer(cfg("progress=none", "mesh.data=1", "name=one"))
    assert dict(t.mesh.shape) == {"data": 1, "tp": 1}


def test_chunked_cross_entropy_head_layouts_agree():
    """The head given as (D, V) and as (V, D) (`head_layout`): the same loss, the same
    gradient of h, and head gradients that are each other's transpose; a bad layout is a
    ValueError."""
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (2, 10, 16))
    head_dv = jax.random.normal(k[1], (16, 40)) * 0.3
    targets = jax.random.randint(k[2], (2, 10), 0, 40)

    def loss(layout):
        def f(h, w):
            return step.chunked_cross_entropy(h, w, targets, chunk=4, head_layout=layout)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    l_dv, (gh_dv, gw_dv) = loss("dv")(h, head_dv)
    l_vd, (gh_vd, gw_vd) = loss("vd")(h, head_dv.T)
    plain = step.cross_entropy(jnp.einsum("btd,dv->btv", h, head_dv), targets)
    assert float(l_dv) == pytest.approx(float(plain), rel=1e-6)
    assert float(l_vd) == pytest.approx(float(plain), rel=1e-6)
    np.testing.assert_allclose(gh_vd, gh_dv, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gw_vd, gw_dv.T, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="head_layout"):
        step.chunked_cross_entropy(h, head_dv, targets, chunk=4, head_layout="DV")
