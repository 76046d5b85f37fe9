"""URLs and headers as they may be shown: in messages, the manifest, a report. Pure, and light
to import (the shard uses it)."""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit, urlunsplit

SECRET_HEADER = re.compile(r"auth|key|token|secret|cookie|password", re.IGNORECASE)
"""A header name that may carry credentials: its value is masked where the job is shown, and
a job with one sends credentials."""


SECRET_QUERY = re.compile(r"auth|key|token|secret|password|sig", re.IGNORECASE)
"""A query parameter name that may carry a credential (`?api_key=`, `?key=`, a signature)."""


def masked_url(url: str) -> str:
    """`https://user:pw@host/v1` -> `https://user:***@host/v1`, and the values of query
    parameters named like credentials (`?key=...` -> `?key=***`); anything else unchanged."""
    parts = urlsplit(url)
    if parts.query:
        fields = [name + "=***" if sep and SECRET_QUERY.search(unquote_plus(name)) else
                  name + sep + value
                  for name, sep, value in (field.partition("=")
                                           for field in parts.query.split("&"))]  # fmt: skip
        parts = parts._replace(query="&".join(fields))
    if parts.password is None:
        return urlunsplit(parts) if parts.query else url
    # The host part as written: `hostname` would drop an IPv6 address's brackets.
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}"))
