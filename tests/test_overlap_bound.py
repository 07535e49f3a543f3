"""`timeline.overlap_bound` (the most the ladder's overlap can gain) and `module_times` on
hand-built schedules: exact values, the two-module closed form, and the model's own two-stream
replay (`timeline.simulate`) of the best ordering as the reference."""

import itertools

import pytest

from ladder_jax.analysis import timeline
from ladder_jax.analysis.timeline import Timed


def test_overlap_bound_exact_values():
    r = timeline.overlap_bound([20.0, 10.0], [15.0, 15.0])
    # attention's all-reduce (15) behind the MLP (10): 5 exposed; the MLP's behind attention
    assert r == {"serial_s": 60.0, "best_s": 35.0, "best_exposed_s": 5.0, "bound": 60.0 / 35.0}
    # with 2 s cross-stream handovers: attention -> its all-reduce -> the next attention is a
    # chain of 14 + 2 + 15 + 2 = 33 a layer, more than the collective stream's 30
    r = timeline.overlap_bound([14.0, 11.0], [15.0, 15.0], wait_s=2.0)
    assert (r["serial_s"], r["best_s"], r["best_exposed_s"]) == (55.0, 33.0, 8.0)
    assert timeline.overlap_bound([10.0], [0.0])["bound"] == 1.0  # nothing to hide
    with pytest.raises(ValueError, match="2 compute times for 1 collectives"):
        timeline.overlap_bound([1.0, 2.0], [3.0])


@pytest.mark.parametrize(
    "c0, c1, a0, a1", itertools.product((4.0, 12.0), (6.0, 15.0), (5.0, 13.0), (3.0, 14.0))
)
def test_two_modules_closed_form(c0, c1, a0, a1):
    """Without waits, a layer of the best schedule takes max(C[1], A[0]) + max(C[0], A[1])."""
    r = timeline.overlap_bound([c0, c1], [a0, a1])
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

    layer = timeline.simulate(ops(41)).seconds - timeline.simulate(ops(40)).seconds
    assert layer == pytest.approx(timeline.overlap_bound(c, a, wait_s=wait)["best_s"], abs=1e-9)


def test_module_times_splits_a_layer_at_its_collectives():
    ops = [
        Timed("compute", "prologue", 7.0),  # no layer, none before it: no layer's
        Timed("compute", "head_of_1", 9.0, layer=0),
        Timed("compute", "qkv", 2.0, layer=1),
        Timed("compute", "attend", 3.0, layer=1),
        Timed("compute", "cache_update", 0.5),  # no layer: the one before it (1)
        Timed("sync", "ar_attn", 5.0, layer=1),
        Timed("compute", "mlp", 4.0, layer=1),
        Timed("start", "ar_mlp", 6.0, layer=1),
        Timed("done", "ar_mlp", 0.0, layer=1),
        Timed("compute", "tail", 1.0, layer=1),  # after the last collective: the first module's
        Timed("compute", "qkv", 2.0, layer=2),
    ]
    assert timeline.module_times(ops, layer=1) == {
        "compute_s": [6.5, 4.0],
        "collective_s": [5.0, 6.0],
    }
    assert timeline.module_times(ops[:5], layer=1) == {"compute_s": [5.5], "collective_s": [0.0]}
    assert timeline.module_times(ops, layer=0) == {"compute_s": [9.0], "collective_s": [0.0]}


def _xla_order(c, a, wait, layers):
    """The order XLA:GPU compiles the ladder's decode step in, one all-reduce in flight at a
    time: kernels of module j, done j - 1, start j."""
    out = []
    for j in range(len(c) * layers):
        out.append(Timed("compute", f"c{j}", c[j % len(c)]))
        if j >= 1:
            out.append(Timed("done", f"ar{j - 1}", 0.0, wait_s=wait))
        out.append(Timed("start", f"ar{j}", a[j % len(a)], wait_s=wait))
    return out + [Timed("done", f"ar{len(c) * layers - 1}", 0.0, wait_s=wait)]


def test_one_in_flight_exact_values():
    # each all-reduce starts two 2 s handovers after the previous one ended: a module takes
    # max(C[j], A[j - 1] + 4), here 15 + 4 both: 38, against 33 when the next all-reduce is
    # queued before the previous one is awaited
    r = timeline.overlap_bound([14.0, 11.0], [15.0, 15.0], wait_s=2.0, one_in_flight=True)
    assert r == {"serial_s": 55.0, "best_s": 38.0, "best_exposed_s": 13.0, "bound": 55.0 / 38.0}
    # compute-bound attention, all-reduce-bound MLP: max(14, 8 + 4) + max(11, 15 + 4) = 33
    r = timeline.overlap_bound([14.0, 11.0], [15.0, 8.0], wait_s=2.0, one_in_flight=True)
    assert (r["best_s"], r["best_exposed_s"]) == (33.0, 8.0)
    # without handover costs the rule costs nothing: the collective stream is one queue anyway
    for c, a in (([14.0, 11.0], [15.0, 15.0]), ([20.0, 10.0, 7.0], [15.0, 3.0, 12.0])):
        assert timeline.overlap_bound(c, a, one_in_flight=True) == timeline.overlap_bound(c, a)


@pytest.mark.parametrize(
    "c, a, wait",
    [
        ([14.0, 11.0], [15.0, 15.0], 2.0),
        ([14.0, 11.0], [15.0, 8.0], 2.0),
        ([20.0, 10.0, 7.0], [15.0, 3.0, 12.0], 1.5),
        ([4.0, 6.0], [13.0, 14.0], 0.0),
    ],
)
def test_one_in_flight_bound_equals_the_replay_of_the_compiled_order(c, a, wait):
    """`simulate` of the order XLA compiles (kernels j, done j - 1, start j) with the same
    waits: its steady-state layer is the one-in-flight `best_s`, sum of max(C[j], A[j - 1] +
    2 wait), never below the unconstrained one."""
    layer = (
        timeline.simulate(_xla_order(c, a, wait, 41)).seconds
        - timeline.simulate(_xla_order(c, a, wait, 40)).seconds
    )
    r = timeline.overlap_bound(c, a, wait_s=wait, one_in_flight=True)
    assert layer == pytest.approx(r["best_s"], abs=1e-9)
    n = len(c)
    assert r["best_s"] == pytest.approx(sum(max(c[j], a[j - 1] + 2 * wait) for j in range(n)))
    assert r["best_s"] >= timeline.overlap_bound(c, a, wait_s=wait)["best_s"] - 1e-12


def test_trace_spans_exact():
    """A hand-built schedule: kernel a, then x's all-reduce (1 s handovers) behind kernel b,
    kernel c after x's done, a blocking y."""
    ops = [
        Timed("compute", "a", 3.0, layer=0),
        Timed("start", "x", 4.0, layer=0, wait_s=1.0),
        Timed("compute", "b", 2.0, layer=1),
        Timed("done", "x", 0.0, layer=0, wait_s=1.0),
        Timed("compute", "c", 1.0, layer=1),
        Timed("sync", "y", 2.0, layer=1),
    ]
    spans = []
    t = timeline.simulate(ops, trace=spans)
    S = timeline.Span
    assert spans == [
        S("kernel", "a", 0.0, 3.0, 0),
        S("collective", "x", 4.0, 8.0, 0),  # a's end + 1 s
        S("kernel", "b", 3.0, 5.0, 1),
        S("kernel", "c", 9.0, 10.0, 1),  # x's end + 1 s
        S("collective", "y", 10.0, 12.0, 1),
    ]
    assert t.seconds == 12.0 and t.comm_s == 6.0
    assert timeline.simulate(ops).seconds == t.seconds  # tracing changes nothing


def _well_formed(spans, t, ops):
    assert all(s.start <= s.end for s in spans)
    for stream in ("kernel", "collective"):
        mine = [s for s in spans if s.stream == stream]
        assert all(p.end <= q.start + 1e-12 for p, q in zip(mine, mine[1:])), stream
    kernels = [s for s in spans if s.stream == "kernel"]
    assert [s.name for s in kernels] == [o.name for o in ops if o.kind == "compute"]
    collectives = [s for s in spans if s.stream == "collective"]
    assert [s.name for s in collectives] == [o.name for o in ops if o.kind in ("start", "sync")]
    assert max(s.end for s in spans) == pytest.approx(t.seconds, abs=1e-12)
    assert sum(s.end - s.start for s in collectives) == pytest.approx(t.comm_s, abs=1e-12)
    assert sum(s.end - s.start for s in kernels) <= t.compute_s + 1e-12


@pytest.mark.parametrize("copy_rate", [1.0, 0.5])
def test_trace_is_well_formed_and_matches_the_time(copy_rate):
    """Both replays (`copy_rate` 0.5: the event replay) on a schedule with contention: each
    stream's spans disjoint, in op order, ending at the returned time; the collectives'
    lengths sum to `comm_s`, the kernels' to at most `compute_s` (its waits excluded)."""
    ops = []
    for j in range(6):
        ops.append(
            Timed("compute", f"k{j}", 5.0 + j % 3, flops_s=2.0, bytes_s=4.0 + j % 3, layer=j)
        )
        if j:
            ops.append(Timed("done", f"ar{j - 1}", 0.0, wait_s=0.5))
        ops.append(
            Timed("start", f"ar{j}", 6.0, sm_share=0.2, hbm_share=0.3, latency_s=2.0, wait_s=0.5)
        )
    ops += [Timed("done", "ar5", 0.0, wait_s=0.5), Timed("sync", "last", 3.0, latency_s=1.0)]
    spans = []
    t = timeline.simulate(ops, copy_rate=copy_rate, trace=spans)
    _well_formed(spans, t, ops)
    assert t.seconds == timeline.simulate(ops, copy_rate=copy_rate).seconds
    if copy_rate < 1.0:  # the copies slowed beside the kernels: longer than their 6 s
        assert max(s.end - s.start for s in spans if s.name.startswith("ar")) > 6.0
