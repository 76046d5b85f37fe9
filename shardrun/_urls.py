"""URLs and headers as they may be shown: in messages, the manifest, a report. Pure, and light
to import (the shard uses it)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

SECRET_HEADER = re.compile(r"auth|key|token|secret|cookie|password", re.IGNORECASE)
"""A header name that may carry credentials: its value is masked where the job is shown, and
a job with one sends credentials."""


def masked_url(url: str) -> str:
    """`https://user:pw@host/v1` -> `https://user:***@host/v1`; anything else unchanged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    # The host part as written: `hostname` would drop an IPv6 address's brackets.
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}"))
