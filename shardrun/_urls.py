"""URLs and headers as they may be shown: in messages, the manifest, a report. Pure, and light
to import (the shard uses it)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

SECRET_HEADER = re.compile(r"auth|key|token|secret|cookie|password", re.IGNORECASE)
"""A header name that may carry credentials: its value is masked where the job is shown, and
a job with one sends credentials."""


SECRET_PARAM = re.compile(r"(?:x[_-])?(?:api|access|auth|bearer|client|private|refresh|session)?"
                          r"[_-]?(?:key|token)|.*(?:secret|passw|credential|authoriz).*", re.I)
"""A request body field name (whole) that may carry a credential: a gateway may read the key
from the body. Narrower than `SECRET_HEADER`: `max_tokens` or `prompt_cache_key` is none."""


def masked_params(value: object, found: list[object] | None = None) -> object:
    """`value` (a job's params) with every string field named like a credential
    (`SECRET_PARAM`), at any depth, as `***`: for the manifest, which a published run carries.
    The values masked are added to `found`. Only strings: a key is one, while a tool's JSON
    schema may name a property `password` or `token` (an object, kept readable) and a
    `secret_level` may be a number."""
    if isinstance(value, dict):
        shown = {}
        for name, field in value.items():
            secret = isinstance(field, str) and SECRET_PARAM.fullmatch(str(name))
            if secret and found is not None:
                found.append(field)
            shown[name] = "***" if secret else masked_params(field, found)
        return shown
    if isinstance(value, list):
        return [masked_params(field, found) for field in value]
    return value


def masked_setting(key: str, value: object) -> object:
    """A job setting's `value` as the manifest records it: `params` with its credential-named
    fields as `***` and the simulator's `auth_required` key as `***`. A resume masks a manifest
    an older version wrote unmasked so, or that key would be a change, printed in the warning."""
    if key == "params":
        return masked_params(value)
    if key == "endpoint.sim" and isinstance(value, dict) and value.get("auth_required"):
        return value | {"auth_required": "***"}  # the key its requests carry
    return value


def credentials_advice(key_env: str | None, base_url: str, headers: Iterable[str]) -> str:
    """What to set when the endpoint refuses the credentials (a run's stop, validate's ping):
    the key's variable by name (`key_env`, when a key is sent); or, when the job sends no
    credentials at all (no key, no password in the URL, no header that could carry one), that
    it sends none."""
    if key_env is not None:
        return f"set the right key in {key_env} (the variable endpoint.api_key_env names)"
    if urlsplit(base_url).password is None and not any(map(SECRET_HEADER.search, headers)):
        return "the job sends no key: name the variable that holds one in endpoint.api_key_env"
    return ("set the right credentials: the key in the variable endpoint.api_key_env names, or "
            "the password in endpoint.base_url or the header in endpoint.headers that carry one")


SECRET_QUERY = re.compile(r"auth|key|token|secret|password|sig|code", re.IGNORECASE)
"""A query parameter name that may carry a credential (`?api_key=`, `?key=`, a signature,
Azure Functions' `?code=`)."""


def _masked_query(query: str) -> str:
    """A query with the values of the fields named like credentials masked. Fields are split at
    '&' and, within those, at ';' (HTML 4's other separator, which many servers take:
    `?a=1;key=s` -> `?a=1;key=***`); a secret's value is masked to the next '&', since a ';' in
    it may be its own (`?key=abc;def` -> `?key=***`, not `?key=***;def`)."""
    fields = []
    for field in query.split("&"):
        subfields = field.split(";")
        for at, subfield in enumerate(subfields):
            name, sep, _ = subfield.partition("=")
            if sep and SECRET_QUERY.search(unquote_plus(name)):
                field = ";".join([*subfields[:at], name + "=***"])
                break
        fields.append(field)
    return "&".join(fields)


def masked_url(url: str) -> str:
    """`https://user:pw@host/v1` -> `https://***@host/v1` (any userinfo: a proxy may take the
    key as the user name alone), the path from its first path parameter on (`/v1;token=...`,
    `/v1;sk-...` -> `/v1;***`), and the values of query parameters named like credentials,
    fields split at '&' or ';' (`?key=...` -> `?key=***`); anything else unchanged.

    All the path after the first ';' is hidden, not only that segment's parameters: a value may
    hold a '/' (`;token=abc/def`), and what follows is then no other segment but the secret's
    rest. A path parameter may have no name (`/v1;sk-...`), so every one is masked."""
    parts = written = urlsplit(url)
    if parts.query:
        parts = parts._replace(query=_masked_query(parts.query))
    if ";" in parts.path:
        parts = parts._replace(path=parts.path.partition(";")[0] + ";***")
    if "@" in parts.netloc:
        # The host part as written: `hostname` would drop an IPv6 address's brackets.
        parts = parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2])
    return url if parts == written else urlunsplit(parts)  # as written when nothing is hidden


def under_v1(url: str) -> str | None:
    """The URL to suggest for a base_url with no path (`http://host:8000` -> its `/v1`, shown
    masked), where OpenAI-compatible servers serve; None for sim:// and a URL with a path."""
    parts = urlsplit(url)
    if url == "sim://" or parts.path.strip("/"):
        return None
    return masked_url(urlunsplit(parts._replace(path="/v1")))


def url_secrets(url: str) -> set[str]:
    """The credentials `masked_url` hides that a server may quote back: the query values named
    like credentials and the path parameters, as sent (`ab/c+d%3D`) and decoded (`ab/c d=`,
    `ab/c+d=`), since a server may quote either form."""
    parts = urlsplit(url)
    raw = [value for field in parts.query.split("&")
           for value in _secret_value(field)]  # fmt: skip
    if ";" in parts.path:
        params = parts.path.partition(";")[2]
        raw += [params, *(p.partition("=")[2] for p in params.split(";"))]
    return {form for value in raw for form in (value, unquote(value), unquote_plus(value))}


def _secret_value(field: str) -> list[str]:
    """The value of a query field named like a credential (split as `_masked_query` splits)."""
    subfields = field.split(";")
    for at, subfield in enumerate(subfields):
        name, sep, _ = subfield.partition("=")
        if sep and SECRET_QUERY.search(unquote_plus(name)):
            return [";".join(subfields[at:]).partition("=")[2]]
    return []


def endpoint_kind(url: str) -> str:
    """What a published figure may say of its endpoint without naming a host: 'simulator'
    (sim://), else the scheme and 'loopback' (this machine) or 'remote', as 'loopback http'."""
    if url == "sim://":
        return "simulator"
    try:
        parts = urlsplit(url)
        host, scheme = parts.hostname or "", parts.scheme
    except ValueError:  # an IPv6 host cut short: what it is cannot be told
        host, scheme = "", url.partition("://")[0] if "://" in url else ""
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    return f"{'loopback' if local else 'remote'} {scheme or 'unknown'}"
