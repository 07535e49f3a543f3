"""The package's layering: data flows config -> model -> jobs (train, inference, interop) ->
analysis -> api -> command lines, and nothing low imports anything high. Read from the source
(every import statement, function-local ones included), so a new arrow up fails here."""

import ast
import pathlib

import ladder_jax

ROOT = pathlib.Path(ladder_jax.__file__).parent

# part -> the parts it may import (itself included): start-up and small shared pieces (BASE),
# then config -> model -> jobs -> analysis / evaluation -> api; `experiments` (runs built on the
# public API) sits above it
BASE = {"config", "hardware", "atomic", "children", "compile_cache", "processes", "runtime"}
ALLOWED = {
    "config": {"config"},
    "hardware": {"hardware"},
    "children": {"children"},
    "compile_cache": {"compile_cache"},
    "atomic": {"atomic", "config"},
    "train_config": {"train_config", "config"},
    "processes": {"processes", "children", "config"},
    "runtime": {"runtime", "processes", "children", "config"},
    "progress": {"progress", "runtime", "processes", "children", "config"},
    "model": {"model"} | BASE,
    "interop": {"interop", "model"} | BASE,
    "loading": {"loading", "interop", "model", "train_config"} | BASE,
    "inference": {"inference", "model", "interop"} | BASE,
    "train": {"train", "model", "interop", "loading", "train_config", "progress"} | BASE,
}
JOBS = {"train", "inference", "model", "interop", "loading", "train_config", "progress"} | BASE
ALLOWED["analysis"] = {"analysis"} | JOBS
ALLOWED["evaluation"] = {"evaluation"} | JOBS
ALLOWED["api"] = {"api", "analysis", "evaluation"} | JOBS
ALLOWED["experiments"] = {"experiments", "api", "analysis", "evaluation"} | JOBS
LIBRARY = set(ALLOWED)


def part(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = (
                [node.module]
                if node.module != "ladder_jax"
                else [f"ladder_jax.{a.name}" for a in node.names]
            )
        for n in names:
            bits = n.split(".")
            if bits[0] == "ladder_jax" and len(bits) > 1:
                out.add(bits[1])
    return out


def library_modules():
    """Every module of the library (`train/__main__.py` is the entry-point shim of cli.train)."""
    return [p for p in sorted(ROOT.rglob("*.py")) if part(p) in LIBRARY and p.name != "__main__.py"]


def test_every_library_module_belongs_to_a_part():
    parts = {part(p) for p in ROOT.rglob("*.py")}
    shims = {"__init__", "decode", "convert", "overlap", "predict", "demo", "serve", "eval", "cli"}
    assert parts - shims <= LIBRARY, parts - shims - LIBRARY


def test_nothing_low_imports_anything_high():
    bad = []
    for p in library_modules():
        for q in imported_parts(p) - ALLOWED[part(p)]:
            bad.append(f"{p.relative_to(ROOT)} imports ladder_jax.{q}")
    assert not bad, bad


def test_the_library_never_imports_a_command_line():
    shims = {"decode", "convert", "overlap", "predict", "demo", "serve", "eval"}
    bad = [
        str(p.relative_to(ROOT)) for p in library_modules() if imported_parts(p) & ({"cli"} | shims)
    ]
    assert not bad, bad


def test_entry_point_shims_only_call_their_command_line():
    for name in ("decode", "convert", "overlap", "predict", "demo", "eval"):
        assert imported_parts(ROOT / f"{name}.py") == {"cli"}, name
    assert imported_parts(ROOT / "train" / "__main__.py") == {"cli"}
