"""Searching a sequence of plans: the answer of a full scan, from fewer probes.

The searches are exact on sequences shaped as the solver's are (falling, then rising);
hypothesis draws such sequences, with plateaus, and the result is compared with a scan.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_offload.passes.search_sequence import first_fitting, first_where, lowest


@st.composite
def falling_then_rising(draw):
    """Non-increasing values, then non-decreasing ones (plateaus allowed on both sides)."""
    falls = draw(st.lists(st.integers(0, 3), min_size=0, max_size=300))
    rises = draw(st.lists(st.integers(0, 3), min_size=0, max_size=300))
    top = sum(falls) + 1
    values = [top]
    for step in falls:
        values.append(values[-1] - step)
    for step in rises:
        values.append(values[-1] + step)
    return values


class Probed:
    """The values, counting the distinct indices a search reads."""

    def __init__(self, values):
        self.values, self.read = values, set()

    def __call__(self, i):
        self.read.add(i)
        return self.values[i]


@settings(max_examples=300, deadline=None)
@given(falling_then_rising(), st.integers(0, 8), st.sampled_from([2, 3, 8, 16]))
def test_first_fitting_is_the_scans_answer_on_falling_then_rising_values(values, slack, fanout):
    bound = min(values) + slack
    probed = Probed(values)
    scan = next(i for i, v in enumerate(values) if v <= bound)
    assert first_fitting(probed, len(values), lambda v: v <= bound, fanout) == scan
    # first_where alone: the scan's answer whenever it finds one
    found = first_where(lambda i: values[i] <= bound, len(values), fanout)
    assert found in (None, scan)


@settings(max_examples=300, deadline=None)
@given(falling_then_rising(), st.sampled_from([3, 4, 8, 16]))
def test_lowest_is_the_first_lowest_value(values, fanout):
    probed = Probed(values)
    assert lowest(probed, len(values), fanout) == values.index(min(values))


def test_a_search_reads_a_logarithmic_number_of_values():
    values = list(range(4096, 0, -1)) + list(range(1, 4096))
    for target in (4000, 2048, 3, 1):
        probed = Probed(values)
        assert first_fitting(probed, len(values), lambda v: v <= target) == values.index(target)
        assert len(probed.read) <= 4 * 9 * math.ceil(math.log(len(values), 4))
    probed = Probed(values)
    assert lowest(probed, len(values)) == 4095
    assert len(probed.read) <= 2 * 9 * math.ceil(math.log(len(values), 4))


def test_nothing_holds_and_edge_sizes():
    assert first_where(lambda i: False, 100) is None
    assert first_fitting(lambda i: 7, 100, lambda v: v < 7) is None
    assert first_where(lambda i: True, 0) is None
    assert first_where(lambda i: True, 1) == 0
    assert lowest(lambda i: 5, 1) == 0
    with pytest.raises(ValueError):
        lowest(lambda i: 0, 0)
    with pytest.raises(ValueError):
        first_where(lambda i: True, 10, fanout=1)


def test_a_fit_inside_a_bump_between_probes_can_be_missed_but_never_invented():
    # Falling, a dip, a bump, then falling again: the search may pass over the dip (a
    # slower plan), but what it returns always holds.
    values = [100, 90, 80, 40, 80, 80, 80, 80, 80, 80, 80, 80, 30, 20, 10]
    found = first_fitting(values.__getitem__, len(values), lambda v: v <= 50, fanout=3)
    assert found is not None and values[found] <= 50


def test_lowest_looks_past_a_narrow_bump_after_a_plateau():
    # The shape of a 16-layer GPT's recompute-only sequence near its lowest plan: a
    # plateau, a bump of four plans, then the lowest value.
    values = list(range(400, 240, -8)) + [240] * 3 + [304] * 4 + [240, 176, 176, 240, 304, 368] + [500, 900]
    assert lowest(values.__getitem__, len(values)) == values.index(176)
    # A bump wider than the patience may hide it: then the lowest before the bump.
    wide = [300, 200] + [250] * 20 + [100, 400]
    assert lowest(wide.__getitem__, len(wide), patience=4) in (1, 22)
