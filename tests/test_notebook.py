"""The quickstart notebook runs top to bottom (executed here, committed without outputs)."""

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_quickstart_notebook_executes(monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel is a fresh process: give it the CPU setup the tests use
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = {i: "".join(o.get("text", "") for o in c.outputs)
               for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert "8 cpu devices" in text
    assert "per rank (64, 1, 8)" in text  # q split over heads
    assert "LOVE, n." in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) == 2
    html = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "text/html" in o.get("data", {})]
    assert any("ladder" in h and "63" in h for h in html)
