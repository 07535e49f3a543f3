"""What a user sees of long work and of results: progress lines where no terminal shows a bar,
`lj.predict`'s rows as a table, `eval --list`, and `--limit` samples that nest."""

import json
import re
import time

import numpy as np
import pytest

from ladder_jax.api import PredictRows
from ladder_jax.cli import eval as eval_cli
from ladder_jax.evaluation.tasks import load_task
from ladder_jax.progress import ProgressLines
from tests.helpers import exit_code, one_line
from tests.test_eval import _write_task

pytestmark = pytest.mark.quick


def _wait_for(lines: list, n: int, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while len(lines) < n:
        assert time.monotonic() < end, lines
        time.sleep(0.01)


def test_progress_lines_show_a_sign_of_life_every_period_and_changes_at_most_that_often():
    out = []
    t0 = time.monotonic()
    with ProgressLines(every_s=0.5, write=out.append) as lines:
        lines.show("compiling x: 0/3 programs")  # the first state: at once
        assert out == ["compiling x: 0/3 programs\n"]
        lines.show("compiling x: 1/3 programs")  # a change within the period: held back
        assert len(out) == 1
        _wait_for(out, 3)  # ...printed by the period's end, then repeated with the time
        assert time.monotonic() - t0 >= 0.5
    assert out[1] == "compiling x: 1/3 programs\n", out
    assert re.fullmatch(r"compiling x: 1/3 programs \(\d+ s so far\)\n", out[2]), out
    stamps = []
    with ProgressLines(every_s=0.3, write=lambda s: stamps.append(time.monotonic())) as lines:
        lines.show("a")
        lines.show("b", now=True)  # a stage's end: at once
        assert len(stamps) == 2
        _wait_for(stamps, 5)
    gaps = np.diff(stamps[1:])
    assert gaps.min() >= 0.29 and gaps.max() < 2.0, gaps  # the period, within scheduling


def test_predict_rows_print_as_a_table_and_stay_a_json_list():
    rows = PredictRows(
        {"preset": "p", "link": link, "tp": 8, "batch": 1, "residual": res, "prefill_s": pre,
         "decode_step_s": step, "tokens_per_s": 1 / step, "tokens_per_s_per_user": 1 / step,
         "vs_standard": ratio}
        for link, res, pre, step, ratio in [
            ("nvlink", "standard", 0.25, 0.02, 1.0),
            ("nvlink", "ladder", 0.2, 0.016, 1.25),
            ("pcie", "upper_bound", 0.1, 0.01, None),
        ]
    )  # fmt: skip
    lines = repr(rows).splitlines()
    assert lines[0].split() == [
        "link", "tp", "batch", "residual", "prefill", "ms", "decode", "ms/tok", "tokens/s",
        "tok/s/user", "vs", "standard",
    ]  # fmt: skip
    assert lines[2].split() == [
        "nvlink", "8", "1", "ladder", "200.0", "16.000", "62.5", "62.5", "1.250x",
    ]  # fmt: skip
    assert lines[3].split()[-1] == "-" and len(lines) == 4
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert json.loads(rows.to_json()) == list(rows) == json.loads(json.dumps(rows))
    html = rows._repr_html_()
    assert html.count("<tr>") == 4 and "<th>vs standard</th>" in html
    assert rows[1]["residual"] == "ladder" and isinstance(rows, list)


def test_eval_list_names_every_task_and_regime(tmp_path, capsys):
    root = tmp_path / "tasks"
    for name, regime in [("arc_x", "rc_0shot"), ("arc_x", "mc_5shot"), ("piqa_y", "rc_0shot")]:
        _write_task(str(root), name, regime, [(0, [("Q:", " a"), ("Q:", " b")], None)])
    assert eval_cli.main(["--list", "--tasks-dir", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"2 tasks in {root}")
    assert out[1:] == ["arc_x: mc_5shot rc_0shot", "piqa_y: rc_0shot"]
    line = one_line(capsys, eval_cli.main(["--list", "--tasks-dir", str(tmp_path / "none")]))
    assert "--tasks-dir" in line and "No such file" in line, line
    assert "required" in one_line(capsys, exit_code(eval_cli.main, []))


def test_eval_help_names_gguf_files(capsys):
    assert exit_code(eval_cli.main, ["--help"]) == 0
    assert "GGUF file (.gguf)" in " ".join(capsys.readouterr().out.split())


def test_a_smaller_limit_samples_among_a_larger_ones_docs(tmp_path):
    docs = [(0, [(f"Q{d}:", " a"), (f"Q{d}:", " b")], None) for d in range(300)]
    _write_task(str(tmp_path), "toy", "rc_0shot", docs)
    task = load_task("toy", "rc_0shot", str(tmp_path))
    ids = {n: [d.doc_id for d in task.subsample(n, seed=0).docs] for n in (20, 40, 299)}
    assert set(ids[20]) < set(ids[40]) < set(ids[299])
    assert all(v == sorted(v) and len(v) == n for n, v in ids.items())
    assert ids[20] != list(range(20))  # a random sample, not the file's head
    other = [d.doc_id for d in task.subsample(20, seed=1).docs]
    assert other != ids[20]
