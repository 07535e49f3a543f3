"""`perfmodel.overlap_bound` (the most the ladder's overlap can gain) and `module_times` on
hand-built schedules: exact values, the two-module closed form, and the model's own two-stream
replay (`perfmodel.simulate`) of the best ordering as the reference."""

import itertools

import pytest

from ladder_jax.analysis import perfmodel
from ladder_jax.analysis.perfmodel import Timed


def test_overlap_bound_exact_values():
    r = perfmodel.overlap_bound([20.0, 10.0], [15.0, 15.0])
    # attention's all-reduce (15) behind the MLP (10): 5 exposed; the MLP's behind attention
    assert r == {"serial_s": 60.0, "best_s": 35.0, "best_exposed_s": 5.0, "bound": 60.0 / 35.0}
    # with 2 s cross-stream handovers: attention -> its all-reduce -> the next attention is a
    # chain of 14 + 2 + 15 + 2 = 33 a layer, more than the collective stream's 30
    r = perfmodel.overlap_bound([14.0, 11.0], [15.0, 15.0], wait_s=2.0)
    assert (r["serial_s"], r["best_s"], r["best_exposed_s"]) == (55.0, 33.0, 8.0)
    assert perfmodel.overlap_bound([10.0], [0.0])["bound"] == 1.0  # nothing to hide
    with pytest.raises(ValueError, match="2 compute times for 1 collectives"):
        perfmodel.overlap_bound([1.0, 2.0], [3.0])


@pytest.mark.parametrize(
    "c0, c1, a0, a1", itertools.product((4.0, 12.0), (6.0, 15.0), (5.0, 13.0), (3.0, 14.0))
)
def test_two_modules_closed_form(c0, c1, a0, a1):
    """Without waits, a layer of the best schedule takes max(C[1], A[0]) + max(C[0], A[1])."""
    r = perfmodel.overlap_bound([c0, c1], [a0, a1])
    assert r["best_s"] == max(c1, a0) + max(c0, a1)
    assert 1.0 <= r["bound"] <= 2.0


@pytest.mark.parametrize("wait", [0.0, 2.0])
def test_overlap_bound_equals_the_replay_of_the_best_order(wait):
    """The ladder's order with each all-reduce started before the previous one is awaited
    (compute j, start j, done j - 1, compute j + 1, ...), replayed by `simulate` with the
    same waits: its steady-state layer equals `best_s`."""
    c, a = [14.0, 11.0], [15.0, 15.0]

    def ops(layers):
        out = []
        for j in range(2 * layers):
            out.append(Timed("compute", f"c{j}", c[j % 2]))
            out.append(Timed("start", f"ar{j}", a[j % 2], wait_s=wait))
            if j >= 1:
                out.append(Timed("done", f"ar{j - 1}", 0.0, wait_s=wait))
        return out + [Timed("done", f"ar{2 * layers - 1}", 0.0, wait_s=wait)]

    layer = perfmodel.simulate(ops(41)).seconds - perfmodel.simulate(ops(40)).seconds
    assert layer == pytest.approx(perfmodel.overlap_bound(c, a, wait_s=wait)["best_s"], abs=1e-9)


def test_module_times_splits_a_layer_at_its_collectives():
    ops = [
        Timed("compute", "head_of_1", 9.0, layer=0),
        Timed("compute", "qkv", 2.0, layer=1),
        Timed("compute", "attend", 3.0, layer=1),
        Timed("sync", "ar_attn", 5.0, layer=1),
        Timed("compute", "mlp", 4.0, layer=1),
        Timed("start", "ar_mlp", 6.0, layer=1),
        Timed("done", "ar_mlp", 0.0, layer=1),
        Timed("compute", "tail", 1.0, layer=1),  # after the last collective: the first module's
        Timed("compute", "qkv", 2.0, layer=2),
    ]
    assert perfmodel.module_times(ops, layer=1) == {
        "compute_s": [6.0, 4.0],
        "collective_s": [5.0, 6.0],
    }
    assert perfmodel.module_times(ops[:3], layer=1) == {"compute_s": [5.0], "collective_s": [0.0]}
