"""The documentation's commands as a newcomer runs them: every block marked `<!-- cpu -->` (the
line before its ```bash fence) of README.md, then of docs/*.md (the order of DOCS, then the
rest by name), in one fresh directory, through bash. Only the sizes shrink (fewer steps and
layers, shorter sequences, a free port, no `pip install`), never the names, meshes or flags, so
every example must get what it promises after the ones before it.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import free_port

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
# docs/ pages in reading order (their examples continue from README's); others follow by name
DOCS = ("training.md", "inference.md", "analysis.md", "architecture.md", "results.md")
# Appended to each train command, before README's own overrides (so those win).
TRAIN = (
    "steps=2 log_every=1 eval_every=0 eval_batches=1 ckpt_every=0 model.n_layers=1 "
    "data.seq_len=16 data.batch_size=4 bench_steps=1 progress=lines"
)
# Appended at the end of each decode command (argparse: the last value wins).
DECODE = "--max-new-tokens 4"
DECODE_BENCH = "--preset tiny --batch 2 --prompt-len 8 --max-new-tokens 3"  # if one is marked


def pages() -> list[pathlib.Path]:
    """README.md, then docs/*.md in reading order."""
    docs = sorted(
        (ROOT / "docs").glob("*.md"),
        key=lambda p: (DOCS.index(p.name) if p.name in DOCS else len(DOCS), p.name),
    )
    return [README, *docs]


def cpu_blocks(text: str) -> list[str]:
    """The bash blocks marked `<!-- cpu -->`, in order."""
    return re.findall(r"<!-- cpu -->\n```bash\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """A block's shell commands, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line)
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def shrink(cmd: str, port: int) -> str:
    cmd = re.sub(r"^(python -m )?pip install [^&]*&&\s*", "", cmd)
    cmd = cmd.replace("configs/tiny.yaml", f"configs/tiny.yaml {TRAIN}")
    cmd = cmd.replace("127.0.0.1:12355", f"127.0.0.1:{port}")
    if "ladder_jax.decode" in cmd:
        cmd += " " + (DECODE_BENCH if "--benchmark" in cmd else DECODE)
    return cmd


@pytest.mark.quick
def test_every_train_example_in_the_docs_has_a_name_of_its_own():
    text = "\n".join(p.read_text() for p in pages())
    names = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for cmd in commands(block):
            if "ladder_jax.train" in cmd and "--help" not in cmd:
                name = re.findall(r"\bname=(\S+)", cmd)
                names.append(name[-1] if name else "tiny (the config's)")
    assert len(names) >= 6
    assert len(set(names)) == len(names), names  # one run directory per example


def test_docs_cpu_commands_run_in_order(tmp_path):
    by_page = {p.name: cpu_blocks(p.read_text()) for p in pages()}
    assert len(by_page["README.md"]) >= 2 and len(by_page["training.md"]) >= 2, (
        "the <!-- cpu --> markers are gone"
    )
    blocks = [b for p in pages() for b in by_page[p.name]]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    logs = []
    for block in blocks:
        script = "\n".join(shrink(c, free_port()) for c in commands(block))
        p = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=tmp_path,
            env=env,
            text=True,
            capture_output=True,
            timeout=900,
        )
        assert p.returncode == 0, (script, p.stdout[-3000:], p.stderr[-3000:])
        assert "Traceback" not in p.stderr, (script, p.stderr[-3000:])
        logs.append((script, p.stdout, p.stderr))
    out = "\n".join(o + e for _, o, e in logs)
    # every example did what it says: nothing was skipped as "already trained"
    assert "nothing to do" not in out, out[-3000:]
    runs = tmp_path / "runs"
    for name in ("tiny", "tiny-ladder", "tiny-2x2", "tiny-2proc"):
        rows = [json.loads(line) for line in (runs / name / "metrics.jsonl").open()]
        assert [r["step"] for r in rows] == [1, 2], name
        assert all(isinstance(r["time"], float) for r in rows)
    assert re.search(r"done: step 2 in [\d.]+ s, held-out loss", out)
    cfg = (runs / "tiny-2x2" / "config.yaml").read_text()
    assert re.search(r"mesh:\n  tp: 2\n  data: 2", cfg), cfg
    assert "residual: ladder" in (runs / "tiny-ladder" / "config.yaml").read_text()
    bench = json.loads((runs / "tiny-bench" / "benchmark.json").read_text())
    assert {r["residual"] for r in bench["results"]} == {
        "standard",
        "parallel",
        "ladder",
        "upper_bound",
    }
    assert "tp=1 has no all-reduce to overlap" in out
    # decode: the new text on stdout; the prompt, then the speed, on stderr
    decode = [(o, e) for s, o, e in logs if "ladder_jax.decode --checkpoint runs/tiny" in s]
    assert decode and decode[0][0].endswith("\n") and "\nLOVE, n.\n" in decode[0][1], decode
    assert re.search(r"tokens/s", decode[0][1]), decode[0][1]


def test_readme_model_on_a_mesh_runs_as_a_plain_script(tmp_path):
    """README's "model itself, on a mesh" block as a user's script: no JAX_PLATFORMS, no fake
    devices, no runtime.setup. It runs, and on a host without a GPU the CUDA plugin's failure
    to find CUDA is not logged at the user with its traceback (`runtime.hush_missing_cuda`)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    block = next(b for b in blocks if "lj.make_mesh(" in b and "lj.Transformer(" in b)
    script = tmp_path / "mesh.py"
    script.write_text(block + "print(logits.shape, standard.config.residual)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.fullmatch(r"\(2, 16, \d+\) standard\n", p.stdout), p.stdout
    # (the script imports flax, so jax, before the package: native lines the CUDA plugin
    # prints at that import are not the package's to filter)
    assert "Jax plugin configuration error" not in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr[-3000:]


def test_readme_test_commands_work_pasted_alone_and_are_what_ci_runs():
    """README's Tests section: each command is one line that installs what it runs (pasted
    alone into a fresh clone, no earlier block needed), and the full one is .ci/run's installs
    and pytest call, in its order."""
    section = README.read_text().split("## Run the tests", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, blocks
    full, quick = (commands(b) for b in blocks)
    assert len(full) == 1 and len(quick) == 1, (full, quick)
    steps = [s.strip() for s in full[0].split("&&")]
    assert steps[0] == 'python -m pip install -q -e ".[test]"' and quick[0].startswith(steps[0])
    assert quick[0].endswith("python -m pytest -q -m quick")
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith(("python -m pip", "python -m pytest"))
    ]
    assert steps == ci, (steps, ci)
