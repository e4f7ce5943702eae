"""benchmarks/step_timeline.py's pieces that need no GPU: the stamped records split into launches and labelled, with
and without the attention's launch among them (the run itself is a device visit's: benchmarks/README.md)."""
import numpy as np
import pytest

from helpers import benchmark_script

T = benchmark_script("step_timeline")


def records(tags_and_grids, layers):
    """One CTA record a CTA of each launch, launches back to back in time (1 us each), ``layers`` times over."""
    rows, t = [], 0
    for _ in range(layers):
        for tag, grid in tags_and_grids:
            for cta in range(grid):
                r = np.zeros(T.REC, np.int64)
                r[[T.TAG, T.GRID, T.BLOCK, T.CTA]] = tag, grid, 256, cta
                r[[T.ENTRY, T.WAITED, T.FILLED, T.END]] = t + cta, t + 100 + cta, t + 50 + cta, t + 900 + cta
                rows.append(r)
            t += 1000
    return np.array(rows)


@pytest.mark.parametrize("attention", [True, False])
def test_launches_are_split_and_labelled_with_or_without_the_attention(attention):
    layer = [(T.PAIR, 4)] + ([(T.ATTENTION, 3)] if attention else []) + [(T.PAIR, 4), (T.PAIR, 6), (T.PAIR, 4)]
    groups = T.launches(records(layer, 3))
    assert [len(g) for g in groups] == [grid for _, grid in layer] * 3
    names = T.launch_names(groups)
    assert names == (["qkv", "attention", "o", "gate_up", "down"] if attention else ["qkv", "o", "gate_up", "down"])
    table = T.summarise(groups, names, 3)
    assert list(table) == names
    # every launch starts 1 us after the one before started, so 1000 - 900 - (grid - 1) ns after its last CTA ended
    assert table["gate_up"]["first in"] == pytest.approx((1000 - 900 - 3) / 1e3)
    assert table["gate_up"]["CTAs"] == 6 and table["down"]["run"] == pytest.approx(0.8)   # wait -> end: 800 ns a CTA


def test_a_wrong_count_of_launches_is_refused():
    groups = T.launches(records([(T.PAIR, 4), (T.PAIR, 6)], 3))
    with pytest.raises(SystemExit, match="expected 4 x 3"):
        T.summarise(groups, T.launch_names(groups), 3)
