"""Tests for the cost arithmetic, against numbers worked out by hand."""

from __future__ import annotations

import pytest

from shardrun.pricing import cost
from shardrun.spec import PricingSpec


def test_per_token_prices() -> None:
    """2M prompt at 0.15/1M = 0.30; 0.5M completion at 0.60/1M = 0.30; 10k wasted at 0.60/1M
    = 0.006; spend 0.606 over 1,000 successes = 0.000606 each."""
    pricing = PricingSpec(input_per_1m=0.15, output_per_1m=0.60)
    got = cost(pricing, 2_000_000, 500_000, 3600.0, successes=1000, wasted_tokens=10_000)
    assert got["basis"] == "tokens"
    assert got["input_cost"] == pytest.approx(0.30)
    assert got["output_cost"] == pytest.approx(0.30)
    assert got["wasted_cost"] == pytest.approx(0.006)
    assert got["spend"] == pytest.approx(0.606)
    assert got["cost_per_success"] == pytest.approx(0.000606)
    assert got["hours"] is None and got["wasted_tokens"] == 10_000


def test_cached_prompt_tokens_at_their_own_price() -> None:
    """Of 2M prompt tokens 1.5M were cached: 0.5M at 0.15/1M = 0.075 plus 1.5M at 0.075/1M =
    0.1125, so input 0.1875; output 0.5M at 0.60/1M = 0.30; spend 0.4875."""
    pricing = PricingSpec(input_per_1m=0.15, output_per_1m=0.60, cached_input_per_1m=0.075)
    got = cost(pricing, 2_000_000, 500_000, 60.0, successes=1000, cached_tokens=1_500_000)
    assert got["input_cost"] == pytest.approx(0.1875)
    assert got["spend"] == pytest.approx(0.4875)
    assert got["cached_tokens"] == 1_500_000
    # No cached price: cached tokens cost the input rate, 2M at 0.15/1M = 0.30.
    unpriced = cost({"input_per_1m": 0.15}, 2_000_000, 0, 60.0, successes=1,
                    cached_tokens=1_500_000)
    assert unpriced["input_cost"] == pytest.approx(0.30)
    # Only a cached price: uncached prompt tokens are free, 1.5M at 0.075/1M = 0.1125.
    only = cost({"cached_input_per_1m": 0.075}, 2_000_000, 0, 60.0, successes=1,
                cached_tokens=1_500_000)
    assert only["basis"] == "tokens" and only["spend"] == pytest.approx(0.1125)


def test_a_cached_count_beyond_the_prompt_count_is_clamped() -> None:
    """A server that reports more cached than prompt tokens (or a negative count) never makes
    the input cost more than the prompt count allows, or negative."""
    rates = {"input_per_1m": 1.0, "cached_input_per_1m": 3.0}
    over = cost(rates, 1_000_000, 0, 1.0, successes=1, cached_tokens=5_000_000)
    assert (over["cached_tokens"], over["input_cost"]) == (1_000_000, pytest.approx(3.0))
    under = cost(rates, 1_000_000, 0, 1.0, successes=1, cached_tokens=-7)
    assert (under["cached_tokens"], under["input_cost"]) == (0, pytest.approx(1.0))


def test_hourly_price() -> None:
    """2.50/h for 1,800 s = 1.25; over 500 successes = 0.0025 each; 10k of 100k generated
    tokens wasted = a tenth of the spend, 0.125."""
    got = cost({"hourly": 2.5}, 0, 90_000, 1800.0, successes=500, wasted_tokens=10_000)
    assert got["basis"] == "hourly"
    assert got["hours"] == pytest.approx(0.5)
    assert got["spend"] == pytest.approx(1.25)
    assert got["cost_per_success"] == pytest.approx(0.0025)
    assert got["wasted_cost"] == pytest.approx(0.125)
    assert got["input_cost"] is None and got["output_cost"] is None


def test_only_an_output_price() -> None:
    """A missing input price counts as free: 1M completion at 2/1M = 2.0 over 4 = 0.5."""
    got = cost({"output_per_1m": 2.0}, 7_000_000, 1_000_000, 60.0, successes=4)
    assert (got["input_cost"], got["spend"], got["cost_per_success"]) == (0.0, 2.0, 0.5)
    assert got["wasted_cost"] == 0.0


def test_no_prices_no_successes() -> None:
    """Without prices every figure is None; with no successes cost per success is None."""
    empty = cost(None, 10, 10, 1.0, successes=1)
    assert empty["basis"] is None and empty["spend"] is None and empty["cost_per_success"] is None
    assert cost(PricingSpec(), 10, 10, 1.0, successes=1)["basis"] is None
    none_ok = cost({"hourly": 1.0}, 0, 0, 3600.0, successes=0)
    assert (none_ok["spend"], none_ok["cost_per_success"], none_ok["wasted_cost"]) == (
        1.0, None, 0.0)  # fmt: skip
