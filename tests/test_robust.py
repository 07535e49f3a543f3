"""Robustness cases found by outside probes: numbers that are not numbers (checkpoints of a
diverged run, NaN logits), loaders that must keep what a file says, a server facing careless
or hostile clients, and processes of one job that must agree or stop. Every case goes through
the command line or API where it was found; every wait is bounded."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ladder_jax import loading, train_config
from ladder_jax.inference import generation
from ladder_jax.inference.sampling import NonFiniteLogits
from ladder_jax.interop.tokenizer import ByteTokenizer
from ladder_jax.train import checkpoint, trainer
from ladder_jax.train.step import TrainState
from tests.helpers import run_module, tiny_model

TOK = ByteTokenizer()
SMALL = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.batch_size=8",
    "eval_batches=2",
    "progress=lines",
    "log_every=1000",
    "optim.warmup_steps=1",
    "mesh.data=1",
    "tensorboard=false",
    "eval_every=0",
]
ONE_DEVICE = {"XLA_FLAGS": ""}  # the processes started here: jax's one CPU device
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", **ONE_DEVICE}


def _one_line_error(r, code=2):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert lines and lines[-1].startswith("error: "), r.stderr
    return lines[-1]


# -- numbers that are not numbers ------------------------------------------------------------


def test_exit_3_marks_the_poisoned_checkpoint_and_resume_skips_it(tmp_path):
    # lr 0 at step 1 (warm-up), then 1e30: step 2's update ruins the weights (finite, but
    # every later gradient is NaN). Checkpoint 2 holds them; checkpoint 1 the sound ones.
    run = ["steps=20", "ckpt_every=1", "max_bad_steps=3", f"run_dir={tmp_path}", "name=run"]
    r = run_module("train", *SMALL, *run, "optim.peak_lr=1e30", env=ONE_DEVICE)
    line = _one_line_error(r, code=3)
    assert "checkpoint(s) 2 marked unsound" in line, line
    assert "a resume starts from checkpoint 1" in line, line
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["1", "2"]  # none written during the non-finite steps
    assert (ckpts / "2" / loading.UNSOUND).exists()
    assert not (ckpts / "1" / loading.UNSOUND).exists()
    # decode and init_from pass the unsound checkpoint over too
    assert loading.find_checkpoint(str(tmp_path / "run"), "x") == str(ckpts / "1" / "params")

    r = run_module(
        "train",
        *SMALL,
        *run,
        "optim.peak_lr=3e-3",
        "steps=4",
        "accept_changes=true",
        env=ONE_DEVICE,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"skipped damaged checkpoint {ckpts}/2: its weights gave non-finite losses" in (
        r.stdout
    ), r.stdout
    assert f"resumed from {ckpts}/1" in r.stdout
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert all(np.isfinite(x["loss"]) and not x.get("skipped") for x in rows[1:])


def test_a_checkpoint_with_nan_weights_is_skipped_on_resume(tmp_path):
    cfg = train_config.load_config(
        SMALL + [f"run_dir={tmp_path}", "name=run", "steps=1", "optim.peak_lr=3e-3"]
    )
    trainer.run(cfg)
    t = trainer.Trainer(
        train_config.load_config(
            SMALL + [f"run_dir={tmp_path}", "name=run", "steps=3", "optim.peak_lr=3e-3"]
        )
    )
    ckpt = checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints"))
    state, meta = ckpt.restore(1, t.state, t.data_iter)
    nan = jax.tree.map(lambda x: x * jnp.nan, state.params)
    assert not checkpoint.params_finite(nan) and checkpoint.params_finite(state.params)
    ckpt.save(TrainState(nan, state.opt_state, 2), t.data_iter, {**meta, "step": 2})
    ckpt.close()
    with pytest.raises(loading.DamagedCheckpoint, match="not finite"):
        checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints")).restore(
            2, t.state, t.data_iter
        )
    out = t.train()
    assert out["exit"] == "done" and sorted(out["losses"]) == [1, 2, 3]
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "2.damaged")


def _nan_model(tp=1):
    model = tiny_model(tp)
    model.final_norm.scale[...] = model.final_norm.scale[...] * jnp.nan
    return model


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "seed": 3}])
def test_generate_refuses_nan_logits(sampling):
    with pytest.raises(NonFiniteLogits, match="logits are NaN or infinite"):
        generation.generate(_nan_model(), ["Once"], max_new_tokens=4, **sampling)


def test_decode_cli_refuses_nan_weights_in_one_line(tmp_path):
    model = _nan_model()
    loading.save_model(model, str(tmp_path / "m"))
    r = run_module(
        "decode",
        "--checkpoint",
        str(tmp_path / "m"),
        "--prompt",
        "Once",
        "--tp",
        "1",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
        env=ONE_DEVICE,
    )
    line = _one_line_error(r)
    assert "logits are NaN or infinite" in line
    assert "\x00" not in r.stdout


def test_server_answers_nan_logits_with_an_error():
    from starlette.testclient import TestClient

    from ladder_jax.inference.batching import Engine
    from ladder_jax.inference.server import create_app

    engine = Engine(_nan_model(), slots=2, max_len=48)
    engine.start()
    try:
        app = create_app(engine, TOK, model_name="m")
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
            assert r.status_code == 500, r.text
            assert "logits are NaN" in r.json()["error"]["message"]
            r = client.post(
                "/v1/completions", json={"prompt": "Once", "max_tokens": 4, "stream": True}
            )
            events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            assert events and "logits are NaN" in events[-1]["error"]["message"], r.text
            assert "[DONE]" not in r.text
            metrics = client.get("/metrics").text
            assert (
                'ladder_requests_total{endpoint="completions",status="500"} 2.0'
                in metrics.splitlines()
            ), metrics
        assert engine.busy == 0 and engine.error is None
    finally:
        engine.drain(5)


# -- loaders ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A 3-layer transformers Llama saved as a Hugging Face directory."""
    import torch
    import transformers

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _with_config(tmp_path, llama_dir, name, **changes):
    from ladder_jax.interop import hf

    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((llama_dir / hf.CONFIG).read_text())
    cfg.update(changes)
    (d / hf.CONFIG).write_text(json.dumps(cfg))
    os.symlink(llama_dir / hf.SINGLE, d / hf.SINGLE)
    return d


def test_load_hf_residual_ladder_keeps_a_llama_configs_ladder_layers(tmp_path, llama_dir):
    import ladder_jax as lj

    mesh = lj.make_mesh(tp=1, devices=jax.devices()[:1])
    plain = _with_config(tmp_path, llama_dir, "plain", ladder_layers=2)
    authors = _with_config(
        tmp_path, llama_dir, "authors", ladder_layers=2, model_type="llamaLadder"
    )
    want = lj.load_hf(authors, mesh=mesh)[0].config  # the authors' convention: upper 2 layers
    assert want.ladder_layer_set() == {1, 2}
    got = lj.load_hf(plain, mesh=mesh, residual="ladder")[0].config
    assert got.ladder_layer_set() == {1, 2} and got == want


@pytest.mark.parametrize(
    "changes",
    [
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": {"type": "linear", "factor": 4.0},
        },
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
        },
    ],
)
def test_rope_scaling_beside_default_rope_parameters_is_refused(tmp_path, llama_dir, changes):
    d = _with_config(tmp_path, llama_dir, "rope", **changes)
    r = run_module("convert", "--hf", str(d), "--out", str(tmp_path / "out"), env=ONE_DEVICE)
    line = _one_line_error(r)
    assert "rope" in line and ("'linear'" in line or "'dynamic'" in line), line
    assert not (tmp_path / "out").exists()


# -- the server and careless or hostile clients ----------------------------------------------

RAISING = (
    "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start "
    "with a user message') }}{% endif %}{% for m in messages %}{{ m.content }}"
    "{% endfor %}"
)


@pytest.fixture(scope="module")
def app_client():
    from starlette.testclient import TestClient

    from ladder_jax.inference.batching import Engine
    from ladder_jax.inference.server import create_app

    engine = Engine(tiny_model(1), slots=2, max_len=48)
    engine.start()
    try:
        with TestClient(
            create_app(engine, TOK, model_name="m", api_key="k", chat_template=RAISING)
        ) as client:
            client.headers["Authorization"] = "Bearer k"
            yield client
    finally:
        engine.drain(5)


def _requests_total(client) -> dict:
    rows = [
        x
        for x in client.get("/metrics").text.splitlines()
        if x.startswith("ladder_requests_total{")
    ]
    return {x.split(" ")[0]: float(x.split(" ")[1]) for x in rows}


def _openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err["message"]


def test_bearer_scheme_is_case_insensitive(app_client):
    body = {"prompt": "Once", "max_tokens": 2, "temperature": 0}
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = app_client.post("/v1/completions", json=body, headers={"Authorization": f"{scheme} k"})
        assert r.status_code == 200, (scheme, r.text)
    assert _openai_error(
        app_client.post("/v1/completions", json=body, headers={"Authorization": "bearer kk"}), 401
    )


@pytest.mark.parametrize(
    "body, match",
    [
        ("[" * 200_000 + "]" * 200_000, "nests too deeply"),
        ('{"prompt": "Once", "max_tokens": ' + "9" * 5000 + "}", "digits"),
        ('{"prompt": "Once", "seed": -' + "1" * 5000 + "}", "digits"),
    ],
    ids=["200000-deep", "5000-digit-int", "5000-digit-negative-int"],
)
def test_pathological_json_is_a_counted_400(app_client, body, match):
    before = _requests_total(app_client)
    r = app_client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert match in _openai_error(r, 400)
    after = _requests_total(app_client)
    key = 'ladder_requests_total{endpoint="completions",status="400"}'
    assert after.get(key, 0) == before.get(key, 0) + 1


def test_a_long_chat_without_max_tokens_is_told_the_prompt_is_too_long(app_client):
    r = app_client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 60}]}
    )
    message = _openai_error(r, 400)
    assert "max_tokens" not in message and "61 tokens" in message, message
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_template_raise_exception_is_the_templates_message(app_client):
    r = app_client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "system", "content": "hi"}], "max_tokens": 2},
    )
    assert "Conversations must start with a user message" in _openai_error(r, 400)
    r = app_client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text


def test_the_kv_cache_fits_the_free_memory(monkeypatch):
    """serve sizes its pool of pages from the host's available memory, its 2 CPU devices'
    halves together: every slot at the model's length when it fits in --memory-fraction, else
    the pages that fit (at least one request at full length), else positions cut to a
    multiple of 64, else one line naming the flags."""
    import argparse

    from ladder_jax import runtime
    from ladder_jax.cli import serve

    model = tiny_model(2)
    c = model.config
    page = 16 * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4  # k and v of 16 positions
    M = c.max_seq_len // 16  # pages of one request at full length

    def plan(free, **flags):
        monkeypatch.setattr(runtime, "available_memory", lambda: free)
        args = {"slots": None, "max_len": None, "memory_fraction": None, **flags}
        return serve._kv_plan(argparse.Namespace(**args), model)

    p = plan(page * (16 * M + 1) * 2)  # fits in half: every slot at the model's length
    assert (p.slots, p.positions, p.pages) == (16, c.max_seq_len, 16 * M + 1)
    assert p.kv_bytes == page * (16 * M + 1)
    p = plan(page * 3 * M * 2)  # room for 3 M pages: shared by the 16 slots
    assert (p.slots, p.positions, p.pages, p.full_length) == (16, c.max_seq_len, 3 * M, 2)
    p = plan(page * 20)  # 10 pages, fewer than M + 1: 9 x 16 = 144 positions, cut to 128
    assert (p.positions, p.pages) == (128, 10)
    with pytest.raises(serve.ConfigError, match="lower --max-len"):
        plan(page * 20, max_len=c.max_seq_len)


def _serve_args(tmp_path, llama_dir):
    bad_jinja = tmp_path / "bad.jinja"
    bad_jinja.write_text("{% for m in messages %}{{ m.content }")
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(bytes(range(256)) * 4)
    garbage = _with_config(tmp_path, llama_dir, "garbage")
    (garbage / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}", ')
    return [
        (["--api-key", ""], {}, "--api-key is empty"),
        ([], {"LADDER_API_KEY": ""}, "LADDER_API_KEY is empty"),
        (["--api-key", "secret\n"], {}, "--api-key holds '\\n'"),
        (["--api-key", "s ecret"], {}, "--api-key holds ' '"),
        (["--api-key", "sécret"], {}, "--api-key holds 'é'"),
        (["--max-len", "-5"], {}, "--max-len -5: must be >= 2"),
        (["--memory-fraction", "1.5"], {}, "--memory-fraction 1.5: a share of the free memory"),
        (["--memory-fraction", "1e-12"], {}, "no room for a KV cache of one request of 64"),
        (["--chat-template", str(bad_jinja)], {}, "the chat template is not valid Jinja"),
        (["--chat-template", str(binary)], {}, "is not UTF-8"),
        (["--checkpoint", str(garbage)], {}, "tokenizer_config.json is not valid JSON"),
    ]


def test_serve_start_up_errors_are_one_line(tmp_path, llama_dir):
    for args, env, match in _serve_args(tmp_path, llama_dir):
        r = subprocess.run(
            [sys.executable, "-m", "ladder_jax.serve", "--no-warmup", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**ENV, **env},
        )
        line = _one_line_error(r)
        assert match in line, (args, line)


def test_partial_requests_time_out_and_a_real_one_gets_through(tmp_path):
    """One loopback client holds 300 connections open mid-request (half with a partial head,
    half with a partial body) against a server limited to 256 open files: each is closed
    after --request-timeout, so a legitimate request (retried while the server has no file
    left for it) gets through; the cut-off uploads are counted, never logged as exceptions."""
    import socket
    import time

    import httpx

    from tests.helpers import free_port

    port = free_port()
    log = open(tmp_path / "server.log", "w")

    proc = subprocess.Popen(  # the shell sets the limit, then becomes the server (exec)
        [
            "sh",
            "-c",
            'ulimit -n 256 && exec "$@"',
            "sh",
            sys.executable,
            "-m",
            "ladder_jax.serve",
            "--preset",
            "tiny",
            "--max-len",
            "64",
            "--slots",
            "2",
            "--no-warmup",
            "--port",
            str(port),
            "--request-timeout",
            "3",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
    )
    url = f"http://127.0.0.1:{port}"
    held = []
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "not healthy in time"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                if i % 2
                else b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b'application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '
            )
            held.append(s)
        # while the files last, libuv accepts and drops new connections: a client retries
        deadline, r = time.monotonic() + 30, None
        while r is None and time.monotonic() < deadline:
            try:
                r = httpx.post(
                    f"{url}/v1/completions",
                    timeout=60,
                    json={"prompt": "Once", "max_tokens": 3, "temperature": 0},
                )
            except httpx.TransportError:
                time.sleep(0.5)
        assert r is not None and r.status_code == 200, r and r.text
        # every held connection was closed by the server (EOF, or a reset)
        for s in held:
            s.settimeout(30)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        cut = [
            x
            for x in metrics.splitlines()
            if x.startswith("ladder_requests_total{") and 'status="499"' in x
        ]
        assert cut and float(cut[0].split()[-1]) >= 1, metrics
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(60)
    text = (tmp_path / "server.log").read_text()
    assert "Traceback" not in text and "Exception in ASGI" not in text, text


# -- many processes that agree or stop -------------------------------------------------------

TWO = SMALL + ["mesh.tp=2", "mesh.data=2", "mesh.cpu_devices=2", "dist.num_processes=2"]


def _train_procs(tmp_path, per_process, env=None):
    from tests.helpers import free_port

    port = free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ladder_jax.train",
                *TWO,
                f"run_dir={tmp_path}",
                "name=run",
                f"dist.coordinator_address=127.0.0.1:{port}",
                f"dist.process_id={i}",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**ENV, **(env or {})},
        )
        for i, extra in enumerate(per_process)
    ]


def _finish(procs, timeout):
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    return out


def test_two_trainers_with_another_learning_rate_refuse_to_start(tmp_path):
    procs = _train_procs(
        tmp_path, [["steps=3", "optim.peak_lr=3e-3"], ["steps=3", "optim.peak_lr=1e-3"]]
    )
    lead, follower = _finish(procs, 180)
    line = _one_line_error(follower)
    assert "process 1 was started with another training config than process 0" in line
    assert "optim.peak_lr is 0.003 there, 0.001 here" in line, line
    assert "process(es) 1 were started with another" in _one_line_error(lead)
    assert not (tmp_path / "run").exists()  # nothing written


def test_two_servers_with_other_slots_refuse_to_start(tmp_path):
    from tests.helpers import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ladder_jax.serve",
                "--preset",
                "tiny",
                "--max-len",
                "64",
                "--no-warmup",
                "--cpu-devices",
                "1",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--slots",
                slots,
                "--port",
                str(free_port()),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for i, slots in enumerate(["4", "8"])
    ]
    lead, follower = _finish(procs, 180)
    assert "flags.slots is 4 there, 8 here" in _one_line_error(follower)
    _one_line_error(lead)


def test_a_process_started_alone_gives_up_in_one_line(tmp_path):
    import time

    t0 = time.monotonic()
    (r,) = _finish(_train_procs(tmp_path, [["steps=3"]], env={"LADDER_PEER_TIMEOUT": "5"}), 120)
    line = _one_line_error(r)
    assert "did not all meet at the coordinator" in line and "within 5 s" in line, line
    # the trainer's own keys, not the other commands' flags
    assert "same dist.coordinator_address and dist.num_processes" in line, line
    assert "its own dist.process_id" in line and "--num-processes" not in line, line
    # it said it was waiting while it waited, not only when it gave up
    assert "process 0 of 2: waiting for the other processes at" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 90


def test_sigterm_ends_a_trainer_blocked_in_a_collective(tmp_path):
    import signal
    import time

    procs = _train_procs(
        tmp_path, [["steps=100000", "ckpt_every=0"]] * 2, env={"LADDER_STOP_GRACE": "5"}
    )
    try:
        metrics_file = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGSTOP)  # the peer stops answering: process 0 blocks
        time.sleep(1)
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        try:
            _, err = procs[0].communicate(timeout=40)
        except subprocess.TimeoutExpired:
            pytest.fail("process 0 did not stop within 40 s of SIGTERM")
        assert procs[0].returncode == 1 and "Traceback" not in err, err[-2000:]
        assert "error: training stopped by SIGTERM" in err.strip().splitlines()[-1], err
        assert time.monotonic() - t0 < 40
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("victim", [1, 0], ids=["follower-dies", "coordinator-dies"])
def test_a_peer_killed_mid_run_ends_the_survivor_in_one_line(tmp_path, victim):
    """kill -9 of one trainer mid-run: the other ends within LADDER_PEER_TIMEOUT (and a
    margin), one line naming the peer, instead of jaxlib's C++ stack or a Gloo traceback."""
    import time

    procs = _train_procs(
        tmp_path, [["steps=100000", "ckpt_every=0"]] * 2, env={"LADDER_PEER_TIMEOUT": "10"}
    )
    try:
        metrics_file = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.5)
        procs[victim].kill()
        t0 = time.monotonic()
        survivor = procs[1 - victim]
        try:
            _, err = survivor.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {1 - victim} still running 60 s after its peer died")
        assert time.monotonic() - t0 < 60
        # exit 1 from the watch; 6 where jaxlib aborts on losing the coordinator
        line = _one_line_error(
            subprocess.CompletedProcess([], survivor.returncode, "", err), code=1 if victim else 6
        )
        assert len(err.strip().splitlines()) == 1, err[-3000:]
        who = "process(es) 1 stopped answering" if victim else "lost process 0, the coordinator"
        assert f"process {1 - victim} of 2: {who}" in line, line
        assert "start every process of the job again" in line
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _decode_procs(pairs, port, env=None, args=()):
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ladder_jax.decode",
                "--preset",
                "tiny",
                "--cpu-devices",
                "1",
                "--max-new-tokens",
                "2",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(n),
                "--process-id",
                str(i),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**ENV, "LADDER_PEER_TIMEOUT": "5", **(env or {})},
        )
        for n, i in pairs
    ]


def test_another_num_processes_is_refused_in_one_line():
    from tests.helpers import free_port

    lead, follower = _finish(_decode_procs([(2, 0), (3, 1)], free_port()), 180)
    assert "num_processes is 2 there, 3 here" in _one_line_error(follower)
    assert "another --num-processes" in _one_line_error(lead)


def test_a_process_id_given_twice_is_refused_in_one_line():
    import socket
    import time

    from tests.helpers import free_port

    port = free_port()
    (first,) = _decode_procs([(2, 0)], port, env={"LADDER_PEER_TIMEOUT": "200"})
    try:  # the first process 0 listens on the coordinator's port: then the second starts
        deadline = time.monotonic() + 120
        while True:
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        (second,) = _finish(_decode_procs([(2, 0)], port), 120)
        line = _one_line_error(second)
        assert f"port {port} is taken here" in line and "--process-id given twice" in line
        assert first.poll() is None  # still waiting for its process 1
    finally:
        first.kill()
        first.wait()


def test_two_decoders_with_another_seed_refuse_to_start():
    from tests.helpers import free_port

    port = free_port()
    lead, follower = _finish(
        [_decode_procs([(2, 0)], port)[0], _decode_procs([(2, 1)], port, args=["--seed", "1"])[0]],
        180,
    )
    assert "flags.seed is 0 there, 1 here" in _one_line_error(follower)
    assert "another model or decoding flags" in _one_line_error(lead)


GLOO = (
    b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
)
# two threads' lines as Gloo printed them into one pipe, their pieces interleaved
TANGLED = (
    b"[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected "
    b"peer ranks is : 1\n1 is connected to 3 peer ranks. Expected number of connected peer "
    b"ranks is : 3\n"
)


@pytest.mark.parametrize("cut", [0, 5, 40, 94, 95, 96, 110, 200])
def test_the_stdout_filter_drops_gloo_lines_however_they_arrive(cut):
    """The child process that filters a multi-process CPU job's stdout gets Gloo's connection
    lines (one whole, then two tangled by two threads) cut into two writes at `cut` bytes: they
    go, newlines included, and nothing else does, lines that only start like them, partial
    lines, numbers and a last line without a newline kept."""
    from ladder_jax.children import output_filters

    text = b"first\n[Gl" + b"ad line\n" + GLOO + TANGLED + b"42\nlast"
    start = len(b"first\n[Glad line\n")
    p = subprocess.Popen(
        [sys.executable, "-I", output_filters.__file__, "stdout"]
        + [x.decode("latin-1") for x in output_filters.GLOO],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    p.stdin.write(text[: start + cut])
    p.stdin.flush()
    # the lines before the cut come out once the filter has read the first write alone
    assert p.stdout.read(start) == b"first\n[Glad line\n"
    p.stdin.write(text[start + cut :])
    p.stdin.close()
    assert p.stdout.read() == b"42\nlast"
    assert p.wait(30) == 0


def test_the_stderr_filter_turns_jaxlibs_fatal_stack_into_one_line():
    """The stderr filter's judge, fed as its child process would be: text before a burst of
    coordination-service log lines passes at once; a burst that is not fatal passes when the
    stream goes quiet; a fatal one becomes one line naming the peers that stopped (once the
    processes met) or the refusal (before)."""
    from ladder_jax.children.output_filters import FATAL, MET, CondenseFatal

    flags = ("--coordinator", "--num-processes", "--process-id")
    burst = b"E0101 12:00:00.000000  4242 coordination_service.cc:1] heartbeat\n"
    f = CondenseFatal(0, 3, 10, flags)
    assert f.feed(b"step 1\n" + MET) == b"step 1\n" and f.wait() is None
    assert f.feed(b"before\n" + burst) == b"before\n" and 0 < f.wait() <= 2
    assert f.idle() == burst and f.wait() is None  # quiet for 2 s: it was not fatal
    assert f.feed(burst) == b""
    stack = b"tasks (stopped sending heartbeats): 1, 2\n" + FATAL + b" ...\n*** Check failure\n"
    assert f.feed(stack) == b"" and f.feed(b"more C++ stack\n") == b""
    line = f.end().decode()
    assert line.count("\n") == 1 and line.startswith("error: process 0 of 3: process(es) 1, 2 ")
    assert "LADDER_PEER_TIMEOUT=10 s" in line and "Check failure" not in line
    early = CondenseFatal(1, 2, 10, flags)
    early.feed(burst + FATAL)
    assert "did not all meet" in early.end().decode() and "--process-id given twice" in (
        early.last_line()
    )
