"""URLs and headers as they may be shown: in messages, the manifest, a report. Pure, and light
to import (the shard uses it)."""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit, urlunsplit

SECRET_HEADER = re.compile(r"auth|key|token|secret|cookie|password", re.IGNORECASE)
"""A header name that may carry credentials: its value is masked where the job is shown, and
a job with one sends credentials."""


SECRET_QUERY = re.compile(r"auth|key|token|secret|password|sig|code", re.IGNORECASE)
"""A query parameter name that may carry a credential (`?api_key=`, `?key=`, a signature,
Azure Functions' `?code=`)."""


def _masked_fields(text: str, sep_fields: str, only_secret: bool) -> str:
    """`name=value` fields joined by `sep_fields` with the values masked: all of them, or
    (`only_secret`) those whose names look like credentials."""
    fields = [name + "=***"
              if sep and (not only_secret or SECRET_QUERY.search(unquote_plus(name)))
              else name + sep + value
              for name, sep, value in (field.partition("=")
                                       for field in text.split(sep_fields))]  # fmt: skip
    return sep_fields.join(fields)


def masked_url(url: str) -> str:
    """`https://user:pw@host/v1` -> `https://***@host/v1` (any userinfo: a proxy may take the
    key as the user name alone), the values of path parameters (`/v1;token=...` ->
    `/v1;token=***`) and of query parameters named like credentials (`?key=...` ->
    `?key=***`); anything else unchanged."""
    parts = written = urlsplit(url)
    if parts.query:
        parts = parts._replace(query=_masked_fields(parts.query, "&", only_secret=True))
    if ";" in parts.path:
        segments = []
        for segment in parts.path.split("/"):
            name, semi, params = segment.partition(";")
            segments.append(name + semi + _masked_fields(params, ";", only_secret=False)
                            if semi else segment)
        parts = parts._replace(path="/".join(segments))
    if "@" in parts.netloc:
        # The host part as written: `hostname` would drop an IPv6 address's brackets.
        parts = parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2])
    return url if parts == written else urlunsplit(parts)  # as written when nothing is hidden
