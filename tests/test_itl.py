"""ItlHistogram: bucket geometry, documented quantile error, exact merges, JSON round trip."""

import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.itl import (
    REL_ERROR,
    SUB_US,
    ItlHistogram,
    bucket_bounds,
    bucket_mid,
    bucket_of,
    nearest_rank,
)

GAPS = st.lists(
    st.one_of(
        st.floats(min_value=0.0, max_value=120.0, allow_nan=False),
        st.floats(min_value=1e-7, max_value=1e-2),
        st.just(0.0),
    ),
    min_size=1,
    max_size=300,
)
TOL = REL_ERROR + 1e-9  # float rounding at bucket edges


def _hist(gaps: list[float]) -> ItlHistogram:
    h = ItlHistogram()
    for g in gaps:
        h.add(g)
    return h


def _close(approx: float, exact: float) -> bool:
    if exact < 1e-6:
        return abs(approx - exact) < 1e-6
    return abs(approx - exact) <= TOL * exact


def test_bucket_geometry() -> None:
    """Eight buckets per octave from 1 µs; sub-µs and negative gaps share bucket -1."""
    assert bucket_of(1e-6) == 0
    assert bucket_of(2e-6) == 8
    assert bucket_of(1e-3) == math.floor(math.log2(1000) * 8)
    assert bucket_of(0.0) == bucket_of(5e-7) == bucket_of(-0.001) == SUB_US
    assert bucket_bounds(SUB_US) == (0.0, 1e-6)
    assert bucket_mid(SUB_US) == 0.0
    lo, hi = bucket_bounds(8)
    assert lo == pytest.approx(2e-6) and hi == pytest.approx(2e-6 * 2 ** (1 / 8))
    assert bucket_mid(8) == pytest.approx(math.sqrt(lo * hi))
    assert abs(REL_ERROR - 0.0443) < 1e-4


def test_bad_input_rejected() -> None:
    """NaN/inf gaps, out-of-range quantiles and empty quantiles raise ValueError."""
    h = ItlHistogram()
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            h.add(bad)
    with pytest.raises(ValueError):
        h.quantile(0.5)
    h.add(0.01)
    with pytest.raises(ValueError):
        h.quantile(1.5)
    with pytest.raises(ValueError):
        bucket_mid(-2)
    with pytest.raises(ValueError):
        ItlHistogram.from_json({"x": 1})
    with pytest.raises(ValueError):
        ItlHistogram.from_json({"3": -1})


def test_nearest_rank_is_robust_to_float_noise() -> None:
    """p95 of 100 values is rank 95, not 96 (0.95 * 100 is 95.00000000000001 in floats)."""
    assert nearest_rank(0.95, 100) == 95
    assert nearest_rank(0.0, 10) == 1
    assert nearest_rank(1.0, 10) == 10
    assert nearest_rank(0.5, 3) == 2


@settings(max_examples=300, deadline=None)
@given(GAPS)
def test_bucket_contains_gap(gaps: list[float]) -> None:
    """Every gap lies in its bucket's bounds, and its midpoint is within the error bound."""
    for g in gaps:
        b = bucket_of(g)
        lo, hi = bucket_bounds(b)
        assert lo * (1 - 1e-12) <= g < hi * (1 + 1e-12)
        assert _close(bucket_mid(b), g)


@settings(max_examples=300, deadline=None)
@given(GAPS, st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=8))
def test_quantile_within_documented_error(gaps: list[float], qs: list[float]) -> None:
    """quantile(q) is within REL_ERROR (1 µs below 1 µs) of the exact nearest-rank quantile."""
    h = _hist(gaps)
    ordered = sorted(gaps)
    for q in [*qs, 0.5, 0.95, 0.99, 1.0]:
        exact = ordered[nearest_rank(q, len(ordered)) - 1]
        assert _close(h.quantile(q), exact), (q, exact, h.quantile(q))


@settings(max_examples=200, deadline=None)
@given(st.lists(GAPS, min_size=1, max_size=5))
def test_merge_equals_single_histogram(parts: list[list[float]]) -> None:
    """Merging per-part histograms (objects or JSON dicts) equals adding every gap to one."""
    whole = _hist([g for part in parts for g in part])
    merged, from_json = ItlHistogram(), ItlHistogram()
    for part in parts:
        merged.merge(_hist(part))
        from_json.merge(orjson.loads(orjson.dumps(_hist(part).to_json())))
    assert merged == whole == from_json
    assert merged.count == whole.count == sum(len(p) for p in parts)
    assert merged.to_json() == whole.to_json()


def test_json_round_trip_is_sparse_with_string_keys() -> None:
    """to_json has string keys and only non-empty buckets; from_json restores it."""
    h = _hist([0.0, 0.02, 0.02, 0.5])
    data = h.to_json()
    assert all(isinstance(k, str) for k in data)
    assert sum(data.values()) == 4 and len(data) == 3
    assert ItlHistogram.from_json(data) == h
    assert ItlHistogram.from_json(data).count == 4


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(GAPS.flatmap(st.sampled_from), st.integers(0, 40)), max_size=20))
def test_add_times_equals_adding_one_by_one(batches: list[tuple[float, int]]) -> None:
    """`add(gap, times)` leaves the histogram exactly as `times` single adds of `gap`."""
    batched, single = ItlHistogram(), ItlHistogram()
    for gap, times in batches:
        batched.add(gap, times)
        for _ in range(times):
            single.add(gap)
    assert batched == single and batched.count == single.count
    assert batched.to_json() == single.to_json()


def test_add_times_validated() -> None:
    """A negative count is refused; zero adds nothing (not even a bucket with count 0)."""
    h = ItlHistogram()
    with pytest.raises(ValueError):
        h.add(0.0, -1)
    h.add(0.5, 0)
    assert h.count == 0 and h.to_json() == {}
