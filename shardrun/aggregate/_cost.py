"""Cost per success, when the job names prices (manifest `effective` keys `pricing.*`).

Two forms: per token (`pricing.input_per_1m`, `pricing.output_per_1m`, in money per million
tokens) and per hour (`pricing.hourly`, money per hour of the endpoint). Either, both or none
may be present; with none, the report has no cost section.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KEYS = ("input_per_1m", "output_per_1m", "hourly")


@dataclass(frozen=True, slots=True)
class Pricing:
    input_per_1m: float | None = None
    output_per_1m: float | None = None
    hourly: float | None = None


def pricing_from_effective(effective: Mapping[str, Any]) -> Pricing | None:
    """Prices from the manifest's `effective` map (`{key: {"value", "source"}}` or plain)."""
    found: dict[str, float] = {}
    nested = _value(effective.get("pricing"))
    for key in KEYS:
        raw = _value(effective.get(f"pricing.{key}"))
        if raw is None and isinstance(nested, Mapping):
            raw = nested.get(key)
        if isinstance(raw, int | float) and not isinstance(raw, bool) and raw >= 0:
            found[key] = float(raw)
    return Pricing(**found) if found else None


def _value(entry: Any) -> Any:
    if isinstance(entry, Mapping) and "value" in entry and "source" in entry:
        return entry["value"]
    return entry


def cost_section(pricing: Pricing | None, *, successes: int, prompt_tokens: int,
                 completion_tokens: int, wasted_tokens: int,
                 duration_s: float) -> dict[str, Any] | None:
    """Token cost, hourly cost and their per-success figures (None without prices)."""
    if pricing is None:
        return None
    out: dict[str, Any] = {"pricing": {k: getattr(pricing, k) for k in KEYS}}
    if pricing.input_per_1m is not None or pricing.output_per_1m is not None:
        p_in = pricing.input_per_1m or 0.0
        p_out = pricing.output_per_1m or 0.0
        total = (prompt_tokens * p_in + (completion_tokens + wasted_tokens) * p_out) / 1e6
        out["token_cost"] = round(total, 6)
        out["token_cost_per_success"] = _per(total, successes)
        out["wasted_token_cost"] = round(wasted_tokens * p_out / 1e6, 6)
    if pricing.hourly is not None:
        total = pricing.hourly * duration_s / 3600
        out["hourly_cost"] = round(total, 6)
        out["hourly_cost_per_success"] = _per(total, successes)
    return out


def _per(total: float, successes: int) -> float | None:
    return round(total / successes, 9) if successes else None
