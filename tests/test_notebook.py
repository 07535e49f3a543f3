"""The quickstart notebook: committed executed (its outputs and plots show on the repository
page), and it still runs top to bottom here.

Refresh the committed outputs after a change (a few minutes on a CPU):
    python -m tests.test_notebook            # executes every notebook in place
"""

import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

from ladder_jax import runtime
from tests.helpers import shrink

NOTEBOOKS = pathlib.Path(__file__).parent.parent / "notebooks"
NOTEBOOK = NOTEBOOKS / "quickstart.ipynb"


def _execute(nb, timeout=900):
    """Runs `nb` in a fresh kernel with the CPU setup the tests use; returns it."""
    env = {"JAX_PLATFORMS": "cpu"}
    old = {k: os.environ.get(k) for k in (*env, "XLA_FLAGS")}
    os.environ.update(env)
    os.environ.pop("XLA_FLAGS", None)  # the notebook makes its own 8 devices
    try:
        NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(NOTEBOOKS)}},
        ).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def _strip_noise(nb):
    """Drops the CUDA plugin's start-up lines (absl, cudart) that the kernel's native stderr
    catches at `import jax` from `nb`'s stream outputs; a stream left empty goes."""
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        kept = []
        for o in c.outputs:
            if o.get("output_type") == "stream":
                lines = o.text.splitlines(keepends=True)
                o.text = "".join(
                    x
                    for x in lines
                    if not runtime._NOISE.search(x)
                    and not x.startswith("WARNING: All log messages before absl")
                )
                if not o.text.strip():
                    continue
            kept.append(o)
        c.outputs = kept
    return nb


def test_committed_notebooks_hold_no_start_up_chatter():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        text = "".join(
            o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
        )
        assert "absl::InitializeLog" not in text and "cuda drivers" not in text, path.name


def test_the_quickstart_is_committed_executed():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("outputs") for c in code), "run it: python -m tests.test_notebook"
    assert not [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for c in code for o in c.outputs) == 2


def test_quickstart_notebook_executes(monkeypatch):
    # the training cell on fewer steps (its logging, evaluation and checkpoint in proportion)
    nb = shrink(
        nbformat.read(NOTEBOOK, as_version=4),
        6,
        steps="8",
        eval_every="4",
        log_every="2",
        ckpt_every="8",
    )
    # the kernel is a fresh process: give it the CPU setup the tests use
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    _execute(nb)
    outputs = {
        i: "".join(o.get("text", "") for o in c.outputs)
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
    }
    text = "\n".join(outputs.values())
    assert "8 cpu devices" in text
    assert "per rank (64, 1, 8)" in text  # q split over heads
    assert "LOVE, n." in text
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) == 2
    html = [
        o["data"]["text/html"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "text/html" in o.get("data", {})
    ]
    assert any("ladder" in h and "63" in h for h in html)


if __name__ == "__main__":
    for path in sys.argv[1:] or sorted(NOTEBOOKS.glob("*.ipynb")):
        path = pathlib.Path(path)
        print(f"executing {path} ...", flush=True)
        t0 = time.monotonic()
        nb = _strip_noise(_execute(nbformat.read(path, as_version=4), timeout=3600))
        nbformat.write(nb, path)
        print(f"  {time.monotonic() - t0:.0f} s", flush=True)
