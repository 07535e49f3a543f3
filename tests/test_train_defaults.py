"""The training defaults a CPU host chooses for a large model (a chunked loss, one data-parallel
device) and for a small one (unchanged: the whole loss at once, one device per core), and the
run's first line saying what was chosen and why."""

import os
import types

import jax
import pytest

from ladder_jax import train_config
from ladder_jax.train import trainer

TINY = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")
# SmolLM2-135M's shapes (benchmarks/train_memory.py) at its batch: 8 x 256 tokens
SMOLLM2 = [
    "model.vocab_size=49152",
    "model.d_model=576",
    "model.n_layers=30",
    "model.n_heads=9",
    "model.n_kv_heads=3",
    "model.d_ff=1536",
    "model.head_dim=64",
    "model.tie_embeddings=true",
    "data.batch_size=8",
    "data.seq_len=256",
]


def _cfg(tmp_path, *over):
    return train_config.load_config([TINY, f"run_dir={tmp_path}", *over])


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})


def test_a_large_model_gets_a_chunked_loss_and_one_device(tmp_path, two_cores):
    cfg = _cfg(tmp_path, *SMOLLM2)
    model = train_config.check(cfg)
    assert 130e6 < model.num_params() < 140e6
    # float32 logits of 8 x 256 positions over 49152 tokens: 384 MiB, over the 64 MiB line
    assert 8 * 256 * 49152 * 4 / 2**20 == 384
    assert trainer.loss_chunk(cfg, model) == 64
    # weights, gradients and two Adam moments in float32: 2 GiB a copy, over 1 GiB
    assert trainer.training_state_bytes(model) == 16 * model.num_params()
    assert trainer.cpu_data_parallel(cfg) == 1
    assert trainer.data_parallel(cfg, cpu=True) == 1
    # what a user sets wins
    assert trainer.loss_chunk(_cfg(tmp_path, *SMOLLM2, "loss_chunk=0"), model) == 0
    assert trainer.loss_chunk(_cfg(tmp_path, *SMOLLM2, "loss_chunk=32"), model) == 32
    assert trainer.data_parallel(_cfg(tmp_path, *SMOLLM2, "mesh.data=2"), cpu=True) == 2
    fake = types.SimpleNamespace(model_config=model, cfg=cfg, loss_chunk=64)
    line = trainer.Trainer._chosen(fake)
    gib = 16 * model.num_params() / 2**30
    assert f"mesh.data null: 1, since a copy of the training state is {gib:.2f} GiB" in line, line
    assert "loss_chunk null: 64 positions at a time" in line and "384 MiB" in line, line


def test_the_tiny_preset_keeps_its_settings_and_says_them(tmp_path, two_cores, capsys):
    """The tiny config: the loss at once and one device per core, as before the large-model
    defaults (its losses are the same); the first line names the per-core choice."""
    cfg = _cfg(tmp_path, "steps=2", "eval_every=0", "ckpt_every=0", "progress=lines")
    model = train_config.check(cfg)
    assert trainer.loss_chunk(cfg, model) == 0 and trainer.cpu_data_parallel(cfg) == 2
    t = trainer.Trainer(cfg)
    assert t.loss_chunk == 0 and dict(t.mesh.shape) == {"data": 2, "tp": 1}
    assert jax.default_backend() == "cpu"
    line = t.describe()
    mib = 16 * model.num_params() / 2**20
    assert (
        f"mesh data=2 x tp=1 (cpu); mesh.data null: one device per CPU core (a copy of the "
        f"training state is {mib:.1f} MiB)" in line
    ), line
    assert "loss_chunk" not in line
