"""What a run cost (DESIGN §4): pure arithmetic over token counts, wall time and prices.

Two bases, never mixed (the job spec refuses both at once):

- per token: `input_per_1m` and `output_per_1m` (currency per million tokens; a missing one
  counts as 0), and `cached_input_per_1m` for the prompt tokens the server read from its
  prompt cache (missing: the input rate). spend = (prompt - cached) × in + cached × cached_in
  + (completion + wasted) × out, all / 1e6. Wasted tokens (completion tokens of attempts that
  failed, paid for and thrown away) are priced at the output rate.
- hourly: a dedicated server at `hourly` per hour. spend = hourly × wall_s / 3600, and
  cost_per_success = hourly × hours / successes (C_hour / R_success). The wasted share is
  spend × wasted / (completion + wasted): the share of generated tokens thrown away, a
  decode-time approximation (prefill is not in it).

`prompt_tokens` is every prompt token billed (include failed attempts if the provider bills
them), `cached_tokens` the part of them the server counted as cached (never more than
`prompt_tokens`), `completion_tokens` those of successful spans only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["PER_MILLION", "cost"]

PER_MILLION = 1_000_000


class _Prices(Protocol):
    @property
    def input_per_1m(self) -> float | None: ...
    @property
    def output_per_1m(self) -> float | None: ...
    @property
    def cached_input_per_1m(self) -> float | None: ...
    @property
    def hourly(self) -> float | None: ...


Pricing = _Prices | Mapping[str, float | None] | None
"""A `PricingSpec`, the same keys in a mapping (a manifest), or None."""


def _price(pricing: Pricing, name: str) -> float | None:
    if pricing is None:
        return None
    if isinstance(pricing, Mapping):
        return pricing.get(name)
    value: float | None = getattr(pricing, name)
    return value


def cost(
    pricing: Pricing,
    prompt_tokens: int,
    completion_tokens: int,
    wall_s: float,
    *,
    successes: int,
    wasted_tokens: int = 0,
    cached_tokens: int = 0,
) -> dict[str, object]:
    """Spend, cost per success and cost of wasted tokens; every figure None without prices.

    Keys: basis ("tokens", "hourly" or None), spend, input_cost (cached prompt tokens
    included), output_cost, hours, cost_per_success (None with no successes), wasted_tokens,
    wasted_cost, cached_tokens.
    """
    hourly = _price(pricing, "hourly")
    rate_in, rate_out = _price(pricing, "input_per_1m"), _price(pricing, "output_per_1m")
    rate_cached = _price(pricing, "cached_input_per_1m")
    # A server's cached count cannot exceed its prompt count; clamp so a bad report (or a
    # mix of attempts that report details and attempts that do not) never prices below zero.
    cached_tokens = max(0, min(cached_tokens, prompt_tokens))
    out: dict[str, object] = {
        "basis": None, "spend": None, "input_cost": None, "output_cost": None, "hours": None,
        "cost_per_success": None, "wasted_tokens": wasted_tokens, "wasted_cost": None,
        "cached_tokens": cached_tokens,
    }  # fmt: skip
    if hourly is not None:
        hours = wall_s / 3600
        spend = hourly * hours
        generated = completion_tokens + wasted_tokens
        wasted_cost = spend * wasted_tokens / generated if generated else 0.0
        out.update(basis="hourly", spend=spend, hours=hours, wasted_cost=wasted_cost)
    elif rate_in is not None or rate_out is not None or rate_cached is not None:
        rate_in = rate_in or 0.0
        rate_cached = rate_in if rate_cached is None else rate_cached
        input_cost = ((prompt_tokens - cached_tokens) * rate_in
                      + cached_tokens * rate_cached) / PER_MILLION  # fmt: skip
        output_cost = completion_tokens * (rate_out or 0.0) / PER_MILLION
        wasted_cost = wasted_tokens * (rate_out or 0.0) / PER_MILLION
        spend = input_cost + output_cost + wasted_cost
        out.update(basis="tokens", spend=spend, input_cost=input_cost, output_cost=output_cost,
                   wasted_cost=wasted_cost)  # fmt: skip
    else:
        return out
    out["cost_per_success"] = spend / successes if successes > 0 else None
    return out
