"""The ladder's training step, as XLA:CPU compiles it, costs what standard's does.

Measured on the compiled program rather than by timing: the size of its fusions. Without
`sharding.compiler_options("cpu")` (see `sharding.CPU_KEEP_BARRIERS_PASS`) XLA:CPU re-computes
the ladder backward's running sum of stream cotangents inside every fusion that consumes it,
so its largest fusion grows with depth (179 instructions at 4 tiny layers, 339 at 8) and the
program holds ~1.8x standard's fused instructions at 8 layers.
"""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import ladder_jax as lj
from ladder_jax import train_config
from ladder_jax.model import quant, sharding
from ladder_jax.train import step
from ladder_jax.train import trainer as trainer_module
from tests import helpers


def fusion_sizes(hlo_text: str) -> list[int]:
    """Instruction count of the computation each `fusion` instruction of a compiled HLO module
    calls (one entry per fusion instruction)."""
    bodies, name, count = {}, None, 0
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
            name, count = line.split()[0].lstrip("%"), 0
        elif line.startswith("}") and name is not None:
            bodies[name], name = count, None
        elif name is not None and " = " in line:
            count += 1
    called = re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", hlo_text)
    return [bodies[c] for c in called]


@functools.cache
def _sizes(residual: str, n_layers: int, tp: int = 1) -> tuple[int, int]:
    """(largest fusion, total fused instructions) of the loss-and-gradients program, compiled
    for the CPU the way the package compiles its training step (`sharding.jit`)."""
    config = lj.ModelConfig.from_preset("tiny", residual=residual, n_layers=n_layers)
    mesh = helpers.mesh(tp)
    graphdef, params = nnx.split(lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((2, 64), jnp.int32)
    fn = sharding.jit(lambda p, t: step.loss_and_grads(graphdef, p, t, t), platform="cpu")
    sizes = fusion_sizes(fn.lower(params, tokens).compile().as_text())
    return max(sizes), sum(sizes)


@pytest.mark.parametrize("tp", [1, 2])
def test_ladder_largest_fusion_does_not_grow_with_depth(tp):
    largest_4, _ = _sizes("ladder", 4, tp)
    largest_8, _ = _sizes("ladder", 8, tp)
    assert largest_8 <= largest_4, (largest_4, largest_8)


def test_ladder_program_is_no_bigger_than_standard():
    _, ladder = _sizes("ladder", 8)
    _, standard = _sizes("standard", 8)
    assert ladder <= 1.05 * standard, (ladder, standard)


def test_cpu_options_keep_the_barriers():
    # the pass name is XLA's; if XLA renames it, the option silently does nothing
    assert sharding.compiler_options("cpu") == {
        "xla_disable_hlo_passes": sharding.CPU_KEEP_BARRIERS_PASS
    }
    config = lj.ModelConfig.from_preset("tiny", residual="ladder", n_layers=2)
    mesh = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    graphdef, params = nnx.split(lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)))
    fn = sharding.jit(lambda p, t: nnx.merge(graphdef, p)(t), platform="cpu")
    text = fn.lower(params, jnp.zeros((1, 8), jnp.int32)).compile().as_text()
    assert "opt-barrier" in text


@pytest.mark.parametrize(
    "scheme",
    [{"residual": "ladder"}, {"residual": "ladder", "ladder_layers": 2}],
    ids=["ladder", "hybrid"],
)
def test_cpu_options_leave_loss_and_gradients_bit_identical(scheme):
    config = lj.ModelConfig.from_preset("tiny", **scheme)
    mesh = lj.make_mesh(tp=2, data=1, devices=jax.devices()[:2])
    graphdef, params = nnx.split(lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, config.vocab_size)

    def fn(p, t):
        return step.loss_and_grads(graphdef, p, t, jnp.roll(t, -1, axis=1))

    got = jax.tree.leaves(sharding.jit(fn, platform="cpu")(params, tokens))
    want = jax.tree.leaves(jax.jit(fn)(params, tokens))  # XLA:CPU's defaults
    for g, w in zip(got, want, strict=True):
        assert (jax.device_get(g) == jax.device_get(w)).all()


def test_training_steps_compile_with_the_cpu_training_options(monkeypatch, tmp_path):
    """Training steps on CPU add `sharding.CPU_TRAIN_OPTIONS` (YNNPACK for dots only, the
    fastest option set measured, `benchmarks/cpu_flags.py`): the option is accepted and
    really changes the program, loss and gradients agree with XLA's defaults to float32
    rounding, a user's own XLA_FLAGS setting of it wins, and the trainer asks for it."""
    assert sharding.compiler_options("cpu", "train") == {
        **sharding.compiler_options("cpu"),
        **sharding.CPU_TRAIN_OPTIONS,
    }
    with pytest.raises(ValueError, match="program='training'"):
        sharding.compiler_options("cpu", "training")  # a typo is not silently ignored
    config = lj.ModelConfig.from_preset("tiny", residual="ladder")
    mesh = lj.make_mesh(tp=2, data=1, devices=jax.devices()[:2])
    graphdef, params = nnx.split(lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, config.vocab_size)

    def fn(p, t):
        return step.loss_and_grads(graphdef, p, t, jnp.roll(t, -1, axis=1))

    train = sharding.jit(fn, platform="cpu", program="train").lower(params, tokens).compile()
    other = sharding.jit(fn, platform="cpu").lower(params, tokens).compile()
    assert train.as_text() != other.as_text()  # an ignored option would change nothing
    for g, w in zip(
        jax.tree.leaves(train(params, tokens)), jax.tree.leaves(other(params, tokens)), strict=True
    ):
        np.testing.assert_allclose(jax.device_get(g), jax.device_get(w), rtol=1e-4, atol=1e-6)

    ((option, _),) = sharding.CPU_TRAIN_OPTIONS.items()
    monkeypatch.setenv("XLA_FLAGS", f"--{option}=")
    assert sharding.compiler_options("cpu", "train") == sharding.compiler_options("cpu")
    monkeypatch.delenv("XLA_FLAGS")

    asked = []
    real_jit = trainer_module.compilation.jit

    def jit(fn, **kw):
        asked.append(kw.get("program", "any"))
        return real_jit(fn, **kw)

    monkeypatch.setattr(trainer_module.compilation, "jit", jit)
    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")
    cfg = train_config.load_config([tiny, f"run_dir={tmp_path}", "mesh.tp=1", "mesh.data=1"])
    t = trainer_module.Trainer(cfg)
    t.compiled_step(t.graphdef, t.state)
    assert asked == ["train", "any"]  # the step, then the evaluation loss


def _slow_weight_gradients(flat: bool) -> int:
    """Dots of the compiled CPU training program (tiny, 2 layers) that contract two transposed
    operands: dim 0 of one and dim 1 of the other, a transposed copy made for it."""
    config = lj.ModelConfig.from_preset("tiny", residual="standard", n_layers=2)
    mesh = lj.make_mesh(tp=1, data=1, devices=jax.devices()[:1])
    model = lj.Transformer(config, mesh=mesh, rngs=nnx.Rngs(0))
    for linear in quant.linears(model):
        assert linear is model.head or linear.flat  # a CPU mesh (the head is read whole)
        linear.flat = flat
    graphdef, params = nnx.split(model)
    fn = sharding.jit(
        lambda p, t: step.loss_and_grads(graphdef, p, t, t), platform="cpu", program="train"
    )
    text = fn.lower(params, jnp.zeros((4, 64), jnp.int32)).compile().as_text()
    return len(
        re.findall(
            r"dot\([^)]*\), lhs_contracting_dims=\{0\}, "
            r"rhs_contracting_dims=\{1\}",
            text,
        )
    )


def test_cpu_weight_gradients_contract_untransposed_operands():
    """Linear layers on a CPU mesh run as 2-D matmuls (`linear.flat_einsum`): XLA:CPU compiles
    their weight gradients as (in, rows) x (rows, out) products of the activations as they
    lie. The 3-D einsums' backward held a transposed copy of one operand and a product of two
    transposed operands per MLP weight (~3x slower on the `small` preset); that form is shown
    here too, so the check is known to see it."""
    assert _slow_weight_gradients(flat=True) == 0
    assert _slow_weight_gradients(flat=False) >= 2 * 3  # the MLP's three, per layer
    from ladder_jax.analysis import programs
    from ladder_jax.model import transformer

    assert not transformer.flat_matmuls(programs.gpu_mesh("h100", 2))  # GPUs keep einsums


def test_cpu_runs_keep_freed_memory(tmp_path):
    """`runtime.setup` on CPU keeps the memory XLA frees (`runtime.keep_freed_memory`): a
    program whose temporaries take a block of 256 MB mostly runs again without faulting it in
    (now and then a run still grows the heap: at most half of 20 runs here), where glibc's
    defaults (LADDER_JAX_HOST_MALLOC=default) fault all of it in on every run."""
    import subprocess
    import sys

    script = tmp_path / "faults.py"
    script.write_text(
        "import resource, jax, jax.numpy as jnp\n"
        "import ladder_jax as lj\n"
        "lj.runtime.setup(cpu_devices=1)\n"
        "f = jax.jit(lambda x: (jnp.sin(x) * 2).sum())\n"
        "x = jnp.ones((64, 1024, 1024))\n"
        "for _ in range(3): f(x).block_until_ready()\n"
        "faulting = 0\n"
        "for _ in range(20):\n"
        "    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    f(x).block_until_ready()\n"
        "    faulting += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0 > 1000\n"
        "print(lj.runtime.keep_freed_memory(), faulting)\n"
    )
    root = os.path.join(os.path.dirname(__file__), "..")
    out = {}
    for mode in ("", "default"):
        env = {**os.environ, "LADDER_JAX_HOST_MALLOC": mode, "PYTHONPATH": root}
        env.pop("XLA_FLAGS", None)
        r = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-2000:]
        kept, faults = r.stdout.split()
        out[mode] = (kept == "True", int(faults))
    assert out["default"] == (False, 20), out  # 1000 pages: 4 MB of the 256 MB block
    assert out[""][0] is True and out[""][1] <= 10, out


@pytest.mark.parametrize("scheme", ["standard", "parallel", "ladder"])
def test_tp1_programs_hold_no_all_reduce(scheme):
    """At tp=1 a module's partial sum is its sum: `sharding.reduce_tp` passes it through
    (`sum_of_one`), where psum over one device compiled to an all-reduce (a copy and a
    rendezvous on XLA:CPU) per module, forward and backward. The program at tp=2 keeps its
    all-reduces (what the count can see), and both give the same loss and gradients."""
    from tests.helpers import loss_and_grads, mesh

    config = dataclasses.replace(lj.ModelConfig.from_preset("tiny"), residual=scheme)
    counts = {}
    for tp in (1, 2):
        graphdef, params = nnx.split(lj.Transformer(config, mesh=mesh(tp), rngs=nnx.Rngs(0)))
        tokens = jnp.zeros((2, 17), jnp.int32)
        fn = jax.jit(lambda p, t: step.loss_and_grads(graphdef, p, t[:, :-1], t[:, 1:]))
        hlo = fn.lower(params, tokens).compile().as_text()
        counts[tp] = len(re.findall(r"\ball-reduce(-start)?\(", hlo))
    assert counts[1] == 0 and counts[2] >= 2 * config.n_layers, counts
    (l1, g1), (l2, g2) = loss_and_grads(config, 1, 1), loss_and_grads(config, 2, 1)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g2)


def test_sum_of_one_refuses_a_real_axis():
    from tests.helpers import mesh

    def local(x):
        return sharding.sum_of_one(x, sharding.TP)

    m = mesh(2)
    f = jax.shard_map(local, mesh=m, in_specs=P(sharding.TP), out_specs=P())
    with pytest.raises(ValueError, match="size 2"):
        f(jnp.ones(4))


def test_the_cpu_decode_profile_names_the_kernels_of_both_programs():
    """benchmarks/cpu_decode_profile.py reads XLA:CPU's trace against the compiled programs:
    every listed kind must be a kernel of that program, with its root op and shape."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "benchmarks", "cpu_decode_profile.py"),
            "--preset",
            "tiny",
            "--batch",
            "2",
            "--prompt-len",
            "16",
            "--new-tokens",
            "4",
            "--top",
            "3",
            "--no-threads",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    sections = re.findall(
        r"^(decode step|prefill): ([0-9.]+) ms of kernel time per run, "
        r"(\d+) kernels\n((?:  .*\n?)+)",
        out.stdout,
        re.M,
    )
    assert [s[0] for s in sections] == ["decode step", "prefill"], out.stdout
    for _, total, count, rows in sections:
        assert float(total) > 0 and int(count) > 0
        kinds = re.findall(r" us each  (.+)$", rows, re.M)
        assert len(kinds) == 3, rows
        # a fusion as 'name: root-op shape', any other instruction as its opcode
        assert all(
            re.fullmatch(r"[\w\-]+: [a-z\-]+ [a-z0-9]+\[[0-9,]*\]|[a-z\-]+", k) for k in kinds
        ), kinds
    assert re.search(r"decode step [0-9.]+ ms, prefill [0-9.]+ ms", out.stdout)


def test_gpu_options_a_running_gpu_refuses_are_dropped_and_said(monkeypatch, capsys):
    """On a running GPU whose jaxlib lacks one of the package's XLA options (a jax other than
    the pinned one), that option is left out, once, with a line on stderr; the rest stay.
    The running backend is faked (the probe compiles on this CPU, whose XLA shares the GPU's
    option table), and a made-up option stands for the missing one."""
    from ladder_jax.model import compilation

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = (("xla_gpu_made_up_option_for_this_test", 1),) + tuple(
        {"xla_gpu_enable_latency_hiding_scheduler": True}.items()
    )
    refused = compilation._refused_by_running_gpu(options)
    assert refused == {"xla_gpu_made_up_option_for_this_test"}
    err = capsys.readouterr().err
    assert "no XLA option xla_gpu_made_up_option_for_this_test" in err
    assert "latency_hiding" not in err
    # the package's own options are all known to the pinned jaxlib: nothing is dropped
    assert sharding.compiler_options("gpu") == {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_all_reduce_combine_threshold_bytes": 0,
        "xla_gpu_experimental_parallel_collective_overlap_limit": 8,
        "xla_disable_hlo_passes": sharding.GPU_KEEP_DOTS_PASS,
    }
