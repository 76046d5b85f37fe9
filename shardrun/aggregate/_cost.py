"""Cost per success, when the job names prices (manifest `effective` keys `pricing.*`).

The arithmetic is `shardrun.pricing.cost` (per token, or per hour of a dedicated server); this
module only finds the prices in the manifest. Without prices the report has no cost section.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardrun.pricing import cost

KEYS = ("input_per_1m", "output_per_1m", "cached_input_per_1m", "hourly")


@dataclass(frozen=True, slots=True)
class Pricing:
    input_per_1m: float | None = None
    output_per_1m: float | None = None
    cached_input_per_1m: float | None = None
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
                 completion_tokens: int, wasted_tokens: int, cached_tokens: int,
                 duration_s: float) -> dict[str, Any] | None:
    """`shardrun.pricing.cost` over the run's tokens and wall time (None without prices)."""
    if pricing is None:
        return None
    out = cost(pricing, prompt_tokens, completion_tokens, duration_s, successes=successes,
               wasted_tokens=wasted_tokens, cached_tokens=cached_tokens)
    rounded = {k: round(v, 9) if isinstance(v, float) else v for k, v in out.items()}
    return {"pricing": {k: getattr(pricing, k) for k in KEYS}, **rounded}
