"""The aggregator: pure functions from event records to the numbers of DESIGN §4.

No file handles and no clock in here: readers (`shardrun.report`) feed parsed event lines to the
folds, and renderers print the document that `build_report` returns. Memory depends on minutes,
shards and open spans, never on the number of spans.

    fold_shard(records)        one shard's log  -> ShardSummary
    fold_coordinator(records)  the coordinator's log -> CoordinatorSummary
    build_report(facts, coordinator, shards) -> the report document (docs/METRICS.md)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shardrun.aggregate._coord import CoordinatorFold
from shardrun.aggregate._cost import Pricing, pricing_from_effective
from shardrun.aggregate._dist import Dist, DistStats
from shardrun.aggregate._document import METHOD_VERSION, SCHEMA, RunFacts, build_report
from shardrun.aggregate._metrics import ratio
from shardrun.aggregate._minutes import MinuteCell, MinuteTally
from shardrun.aggregate._passes import pass_settings, recorded_passes
from shardrun.aggregate._segments import BUCKETS, SEGMENT_LABELS, segment_of
from shardrun.aggregate._shard import MINUTES_ONLY_EVENTS, ShardFold
from shardrun.aggregate._steps import Scheduler, StepTrace
from shardrun.aggregate._summary import CoordinatorSummary, ShardSummary
from shardrun.aggregate._tpm import is_full, minute_label, parse_minute

__all__ = [
    "BUCKETS",
    "METHOD_VERSION",
    "MINUTES_ONLY_EVENTS",
    "SCHEMA",
    "SEGMENT_LABELS",
    "CoordinatorFold",
    "CoordinatorSummary",
    "Dist",
    "DistStats",
    "MinuteCell",
    "MinuteTally",
    "Pricing",
    "RunFacts",
    "Scheduler",
    "ShardFold",
    "ShardSummary",
    "StepTrace",
    "build_report",
    "fold_coordinator",
    "fold_shard",
    "is_full",
    "minute_label",
    "parse_minute",
    "pass_settings",
    "pricing_from_effective",
    "ratio",
    "recorded_passes",
    "segment_of",
]


def fold_shard(records: Iterable[Mapping[str, Any]], **options: Any) -> ShardSummary:
    """Fold one shard's records (in file order); `options` as for `ShardFold`."""
    end_t = options.pop("end_t", None)
    fold = ShardFold(**options)
    for rec in records:
        fold.feed(rec)
    return fold.finish(end_t)


def fold_coordinator(records: Iterable[Mapping[str, Any]]) -> CoordinatorSummary:
    """Fold the coordinator's records."""
    fold = CoordinatorFold()
    for rec in records:
        fold.feed(rec)
    return fold.summary
