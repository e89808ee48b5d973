"""Searching a sequence of plans: the answer of a full scan, from fewer probes.

The searches are exact on sequences shaped as the solver's are (falling, then rising);
hypothesis draws such sequences, with plateaus, and the result is compared with a scan.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_offload.passes.solve.search_sequence import count_within, first_fitting, first_where, lowest
from compile_offload.passes.solve.recompute import Candidate, Prefix, pick, search_sequences


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


def test_a_bump_at_the_end_of_a_whole_sequence_is_not_taken_for_the_lowest():
    # The peaks of a small chain's greedy sequence (the solver's monotonicity test met
    # them): the last is below the one before, but the middle one is the lowest.
    values = [3140, 3364, 2852, 3364, 3140]
    assert lowest(values.__getitem__, len(values)) == 2
    # Where the caller cut the range short by price, values still falling at its end have
    # their lowest last: two reads.
    falling = list(range(1000, 0, -1))
    probed = Probed(falling)
    assert lowest(probed, len(falling), cut_short=True) == 999
    assert len(probed.read) == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=120), st.sampled_from([3, 8]))
def test_lowest_is_never_above_a_probe_of_first_where(values, fanout):
    # The solver falls back to the lowest plan it simulated when nothing fits. The plans
    # first_where probes (when none fits) differ with the budget; lowest must not find one
    # above any of them, or a lower budget gets a higher fallback. Any values: bumps too.
    probed = Probed(values)
    assert first_where(lambda i: probed(i) < 0, len(values), fanout) is None
    assert values[lowest(values.__getitem__, len(values), fanout)] <= min(values[i] for i in probed.read)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=200), st.integers(-1, 400))
def test_count_within_is_the_scans_count_on_rising_prices(steps, limit):
    prices = [sum(steps[:i]) for i in range(len(steps) + 1)]
    assert count_within(prices.__getitem__, len(prices), limit) == sum(1 for p in prices if p <= limit)


# --- several sequences: solve.search_sequences -------------------------------------------------


class Sequences:
    """Sequences of fake plans with given peaks and prices, read through the solver's
    ``PlanEvaluator`` protocol; counts the plans simulated."""

    def __init__(self, shapes):
        self.sequences, self.values = [], {}
        for number, (peaks, prices) in enumerate(shapes):
            sequence = []
            for i, (peak, price) in enumerate(zip(peaks, prices)):
                plan = Prefix(frozenset({(number, i)}), frozenset(), ())
                self.values[plan.saved] = (peak, price)
                sequence.append(plan)
            self.sequences.append(sequence)
        self.simulated = set()
        self.bounds = {}  # plan -> a lower bound of its peak (none: 0)

    def price(self, plan):
        return self.values[plan.saved][1], None

    def __call__(self, plan):
        self.simulated.add(plan.saved)
        peak, price = self.values[plan.saved]
        return Candidate(plan.saved, price, peak)

    def bound(self, plan):
        return self.bounds.get(plan.saved, 0)


@st.composite
def solver_sequences(draw):
    """A few sequences as the solver makes them: peaks falling then rising, prices rising
    (each a little above the one before, ties allowed), starting anywhere."""
    shapes = []
    steep = draw(st.sampled_from([1, 20]))  # steep sides: a budget fits a narrow stretch
    for _ in range(draw(st.integers(1, 5))):
        peaks = [steep * value for value in draw(falling_then_rising())]
        start = draw(st.integers(0, 50))
        steps = draw(st.lists(st.integers(0, 3), min_size=len(peaks) - 1, max_size=len(peaks) - 1))
        shapes.append((peaks, [start + sum(steps[:i]) for i in range(len(peaks))]))
    return shapes


@settings(max_examples=300, deadline=None)
@given(solver_sequences(), st.integers(-5, 40))
def test_search_sequences_chooses_what_simulating_every_plan_chooses(shapes, slack):
    sequences = Sequences(shapes)
    budget = min(peak for peaks, _ in shapes for peak in peaks) + slack
    every = [sequences(plan) for sequence in sequences.sequences for plan in sequence]
    searched = Sequences(shapes)
    candidates = search_sequences(searched.sequences, searched, budget)
    chosen, fits = pick(candidates, budget)
    expected, expected_fits = pick(every, budget)
    assert fits == expected_fits
    # the same price and peak (a plan of equal price and peak elsewhere may be the one found)
    assert (chosen.extra_seconds, chosen.peak_bytes) == (expected.extra_seconds, expected.peak_bytes)
    assert all(c.saved in searched.simulated for c in candidates)


def test_a_sequence_dearer_than_a_fitting_plan_is_not_searched():
    falling = list(range(100, 0, -1))
    shapes = [(falling, list(range(100))),  # fits from index 60 on (price 60)
              ([500] * 100, list(range(70, 170)))]  # never fits, and every plan is dearer
    searched = Sequences(shapes)
    chosen, fits = pick(search_sequences(searched.sequences, searched, 40), 40)
    assert fits and chosen.extra_seconds == 60
    # the first sequence's probes find the fitting plan; the second's first plan is dearer
    assert not any(number == 1 for plan in searched.simulated for number, _ in plan)


def test_a_narrow_fitting_stretch_between_probes_is_found():
    v_shape = [10 * abs(i - 110) + 10 for i in range(200)]  # fits 25 at 109-111 only
    shapes = [(v_shape, list(range(200))), (v_shape, [price + 0.5 for price in range(200)])]
    searched = Sequences(shapes)
    chosen, fits = pick(search_sequences(searched.sequences, searched, 25), 25)
    assert fits and chosen.extra_seconds == 109
    assert len(searched.simulated) < 100


@settings(max_examples=300, deadline=None)
@given(falling_then_rising(), st.integers(0, 8), st.sampled_from([2, 3, 8, 16]), st.data())
def test_a_lower_bound_changes_no_answer_and_reads_no_more_values(values, slack, fanout, data):
    below = data.draw(st.lists(st.integers(0, 40), min_size=len(values), max_size=len(values)))
    bounds = [max(0, value - gap) for value, gap in zip(values, below)]
    budget = min(values) + slack
    plain, bounded = Probed(values), Probed(values)
    fits = lambda v: v <= budget  # noqa: E731
    assert (first_fitting(bounded, len(values), fits, fanout, bound=bounds.__getitem__)
            == first_fitting(plain, len(values), fits, fanout))
    assert bounded.read <= plain.read
    plain, bounded = Probed(values), Probed(values)
    fanout = max(3, fanout)
    assert lowest(bounded, len(values), fanout, bound=bounds.__getitem__) == lowest(plain, len(values), fanout)
    assert bounded.read <= plain.read


def test_a_bound_above_the_budget_skips_the_value():
    values = list(range(100, 0, -1))
    probed = Probed(values)
    # exact bounds: only the values that fit, and the one before the answer at most, are read
    assert first_fitting(probed, len(values), lambda v: v <= 30, bound=values.__getitem__) == 70
    assert all(values[i] <= 30 for i in probed.read)


def test_the_window_before_the_first_fitting_probe_is_scanned_not_bisected():
    # Near a sequence's lowest plan peaks bump: here index 9 fits, 10 does not, 11 (a
    # probe) does. The first that fits is 9; a bisection of 9..11 would stop at 11, a
    # slower plan (the budget contract's HF GPT-2 at 0.8 met this).
    holds = [False] * 9 + [True, False] + [True] * 9
    assert first_where(holds.__getitem__, len(holds), fanout=8) == 9
