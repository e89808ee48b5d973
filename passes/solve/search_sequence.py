"""Find a plan along a sequence of candidate plans without simulating all of them.

A greedy sequence (``passes.solve.recompute``, ``passes.solve.joint``) lists plans with rising
predicted step time. Their simulated peaks fall along it to a lowest plan and then rise
again (past it, the greedy recomputes the residual stream block by block, which raises
the peak): measured on GPT-style stacks, every sequence's peaks fall monotonically up to
the first plans near their lowest, with small bumps only there. Simulating a plan costs a
pass over the whole graph, and a sequence holds a few plans per layer, so simulating every
plan makes planning quadratic in depth.

The searches probe ``fanout`` evenly spaced plans of a range, then search the window
that must hold the answer the same way, until the window is small enough to scan: about
``fanout * log(n)`` simulations instead of ``n``.

- ``first_where(holds, n)``: the first index where ``holds``, when some probe holds. Exact
  when ``holds`` does not flip back from true to false before that probe, which peaks that
  fall and then rise give for ``peak <= bound``. It returns None when no probe holds,
  which does not mean nothing does: a bound just above the lowest peak fits a narrow
  stretch that probes can step over.
- ``lowest(peak, n)``: the index of the lowest value (the first of equals), exact on values
  that fall and then rise (plateaus included), and then on past bumps narrower than
  ``PATIENCE`` plans after the lowest value found. On any values, what it returns is no
  higher than a value it read, nor than any of ``first_where``'s probes (its first round
  reads them, or skips those whose bound is above a value read): a caller that falls back
  to the lowest plan simulated gets the same plan whatever the budget was. A range
  the caller ``cut_short`` by price whose values still fall at its end (the last below
  the one before) has its lowest last: two reads.
- ``first_fitting(peak, n, fits)``: ``first_where``, and where no probe fits, the search
  again up to the lowest plan when that one fits: exact on values that fall and then rise.
  Its halves, ``probed_fit`` and ``fitting_around_lowest``, let a caller searching several
  sequences skip the second (the expensive one) where another sequence's fitting plan is
  cheaper than anything left to find (``count_within``: the plans priced at most a bound).

Where the peaks rise and fall again (a bump), a plan that fits only inside the bump can be
passed over; the solver then chooses among the plans it found, a slower plan, never one
over the budget (what a search returns was simulated and fits).

Indices are probed through ``peak``/``holds`` only, so the caller's memo decides what a
probe costs (the solver's ``Evaluator`` simulates each plan once). The searches on peaks
take an optional ``bound``: a lower bound of ``peak`` that costs far less (the solver's:
the saved bytes the backward starts with, ``passes.solve.peak_bound``). Where the bound does not
fit, the peak does not either; in ``lowest``, an index whose bound is above a peak read
cannot hold the lowest. Its peak is then not read, and the answer is the same.
"""

from __future__ import annotations

from collections.abc import Callable

FANOUT = 8
PATIENCE = 16


def _probes(lo: int, hi: int, fanout: int) -> list[int]:
    """``fanout`` or so evenly spaced indices of ``range(lo, hi)``, its last included."""
    step = -(-(hi - lo) // fanout)
    probes = list(range(lo + step - 1, hi, step))
    if not probes or probes[-1] != hi - 1:
        probes.append(hi - 1)
    return probes


def first_where(holds: Callable[[int], bool], n: int, fanout: int = FANOUT) -> int | None:
    """The first index of ``range(n)`` where ``holds``, or None when no probe holds.

    The window before the first probe that holds is probed the same way again, not
    bisected: a bisection is exact only where ``holds`` is false and then true across the
    whole window, and near a sequence's lowest plan peaks bump (HF GPT-2 of the budget
    contract at 0.8: a bisection took a plan 1.3% slower than the first that fits)."""
    if fanout < 2:
        raise ValueError(f"fanout={fanout}: at least 2")
    lo, hi = 0, n
    while hi - lo > fanout:
        previous = lo - 1
        for probe in _probes(lo, hi, fanout):
            if holds(probe):
                lo, hi = previous + 1, probe + 1  # the answer is after the last probe that did not hold
                break
            previous = probe
        else:
            return None
        if hi - lo == 1:
            return lo
    return next((i for i in range(lo, hi) if holds(i)), None)


def lowest(peak: Callable[[int], int | float], n: int, fanout: int = FANOUT, patience: int = PATIENCE,
           bound: Callable[[int], int | float] | None = None, cut_short: bool = False) -> int:
    """The index of the lowest ``peak`` in ``range(n)`` (the first of equals). ``n`` >= 1.
    After the search, the values following the lowest found are read until ``patience``
    of them in a row are no lower: a bump narrower than that next to the lowest value
    (measured on a 16-layer GPT's recompute sequence: 4 plans) does not hide it.
    ``bound``: a lower bound of ``peak``; an index whose bound is above a value already
    read cannot hold the lowest one, and its peak is not asked for. ``cut_short``: the
    caller cut the range short by price (``count_within``), so values still falling at its
    end have their lowest last. Only there: on a whole sequence, a bump at its end is not
    the lowest (5 plans peaking 3140, 3364, 2852, 3364, 3140: the last is not)."""
    if n < 1:
        raise ValueError("lowest of an empty range")
    if fanout < 3:
        raise ValueError(f"fanout={fanout}: at least 3")
    bound = bound or peak
    if cut_short and n >= 2 and bound(n - 1) < peak(n - 2) and peak(n - 1) < peak(n - 2):
        # Still falling where the price cut the range: on values that fall then rise, the
        # last is the lowest, and the first of its value.
        return n - 1
    lo, hi = 0, n
    earlier: list[int] = []  # each round's lowest probe: the answer is never above them
    while hi - lo > fanout:
        probes = sorted({lo, *_probes(lo, hi, fanout)})
        at = _least(peak, bound, probes)
        earlier.append(at[0])
        first, last = probes.index(at[0]), probes.index(at[-1])
        # Values fall then rise, so the lowest lies strictly between the probes on either
        # side of the probes holding the lowest probed value.
        window = (probes[first - 1] + 1 if first > 0 else lo, probes[last + 1] if last + 1 < len(probes) else hi)
        if window == (lo, hi):  # every probe on one plateau: only a scan can tell
            break
        lo, hi = window
    best = _least(peak, bound, range(lo, hi))[0]
    i = best + 1
    while i < n and i - best <= patience:
        if bound(i) < peak(best) and peak(i) < peak(best):
            best = i
        i += 1
    # On values that fall then rise no earlier probe is lower; elsewhere the window can
    # leave a low probe behind, and a lower value was read than the one returned.
    return min([best, *earlier], key=lambda i: (peak(i), i))


def _least(peak: Callable[[int], int | float], bound: Callable[[int], int | float], indices) -> list[int]:
    """The indices of ``indices`` holding their least ``peak``, in order. Peaks are read in
    the order of their bounds, until the next bound is above the least peak read: every
    index left holds more."""
    least, at = None, []
    for i in sorted(indices, key=lambda i: (bound(i), i)):
        if least is not None and bound(i) > least:
            break
        value = peak(i)
        if least is None or value < least:
            least, at = value, [i]
        elif value == least:
            at.append(i)
    return sorted(at)


def first_fitting(peak: Callable[[int], int | float], n: int, fits: Callable[[int | float], bool],
                  fanout: int = FANOUT, bound: Callable[[int], int | float] | None = None) -> int | None:
    """The first index of ``range(n)`` whose ``peak`` ``fits`` (``fits`` holds for every
    value below one that fits), or None. On values that fall then rise this is exact: where
    no probe of ``first_where`` fits, the fitting stretch, if any, lies around the lowest
    value, and the values fall up to it (``fitting_around_lowest``)."""
    found = probed_fit(peak, n, fits, fanout, bound)
    if found is None:
        found = fitting_around_lowest(peak, n, fits, fanout, bound)
    return found


def probed_fit(peak: Callable[[int], int | float], n: int, fits: Callable[[int | float], bool],
               fanout: int = FANOUT, bound: Callable[[int], int | float] | None = None) -> int | None:
    """``first_fitting``'s first half: the first index whose ``peak`` ``fits`` when a probe
    of ``first_where`` fits; None says no probe did (a narrow stretch around the lowest
    value may still fit). The first value is read first: where it fits (an unconstrained
    plan under a generous budget) nothing else is."""
    holds = _fitting(peak, fits, bound)
    if n > 0 and holds(0):
        return 0
    return first_where(holds, n, fanout)


def fitting_around_lowest(peak: Callable[[int], int | float], n: int, fits: Callable[[int | float], bool],
                          fanout: int = FANOUT, bound: Callable[[int], int | float] | None = None,
                          cut_short: bool = False) -> int | None:
    """``first_fitting``'s second half, where no probe fitted: the lowest value of
    ``range(n)``, and when it fits, the first index that fits before it; else None.
    ``cut_short`` as for ``lowest``."""
    if n < 1:
        return None
    bottom = lowest(peak, n, max(3, fanout), bound=bound, cut_short=cut_short)
    if not fits(peak(bottom)):
        return None
    return first_where(_fitting(peak, fits, bound), bottom + 1, fanout)


def _fitting(peak: Callable[[int], int | float], fits: Callable[[int | float], bool],
             bound: Callable[[int], int | float] | None) -> Callable[[int], bool]:
    """Whether index ``i``'s peak fits, asking the peak only where its lower ``bound`` fits
    (``fits`` holds for every value below one that fits, so a bound that does not fit
    rules the peak out)."""
    if bound is None:
        return lambda i: fits(peak(i))
    return lambda i: fits(bound(i)) and fits(peak(i))


def count_within(price: Callable[[int], float], n: int, limit: float) -> int:
    """How many leading indices of ``range(n)`` have ``price`` at most ``limit``, for
    prices that rise along the range (a binary search: about ``log2(n)`` prices read)."""
    lo, hi = 0, n
    while lo < hi:
        middle = (lo + hi) // 2
        if price(middle) <= limit:
            lo = middle + 1
        else:
            hi = middle
    return lo
