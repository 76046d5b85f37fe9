"""Which HTTP proxy the shards send requests through: the standard variables, read once per run.

curl, pip, requests and the OpenAI SDK send a request through the proxy that `https_proxy`
(`http_proxy` for an http URL) or else `all_proxy` names, unless `no_proxy` lists the host; the
lower-case spelling of a variable wins over the upper-case one. shardrun does the same:

- once per run, in the coordinator; the proxy travels to the shards in their configuration (a
  shard may run where the environment differs). aiohttp's own `trust_env=True` is not used: it
  looks the proxy up for every request, in a worker thread;
- never for the embedded simulator (`sim://`), a process of this run on loopback;
- credentials in the proxy's URL become a `Proxy-Authorization` value; the manifest records
  only the URL without them and the variable it came from.

Only HTTP proxies are supported (an https endpoint is reached through them with CONNECT); a
variable naming another kind (`socks5://`) is an error that names it.
"""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from shardrun.errors import SpecError

__all__ = ["Proxy", "bypassed", "proxy_for"]


@dataclass(frozen=True)
class Proxy:
    """A proxy to send requests through."""

    url: str  # scheme://host:port, without credentials
    variable: str  # the environment variable that named it
    authorization: str | None = None  # the Proxy-Authorization header's value, if any

    def describe(self) -> dict[str, str]:
        """What the manifest records: never the credentials."""
        return {"url": self.url, "from": self.variable}


def proxy_for(base_url: str, env: Mapping[str, str]) -> Proxy | None:
    """The proxy for requests to `base_url` under `env`, or None to connect directly."""
    parts = urlsplit(base_url)
    found = _first_set(env, f"{parts.scheme}_proxy", "all_proxy")
    if found is None:
        return None
    variable, value = found
    no_proxy = _first_set(env, "no_proxy")
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    if no_proxy is not None and bypassed(parts.hostname or "", port, no_proxy[1]):
        return None
    return _parse(variable, value)


def bypassed(host: str, port: int | None, no_proxy: str) -> bool:
    """Whether `no_proxy` (comma-separated) exempts host:port from the proxy.

    An entry is `*` (every host), a name that matches itself and its subdomains (a leading dot
    changes nothing) or an IP address or network (`10.0.0.0/8`), as curl reads them; and, as
    Python's urllib allows, optionally with `:port` (IPv6 in brackets then: `[::1]:8000`).
    `port` is the endpoint's port, its scheme's default if the URL has none.
    """
    host = host.lower().rstrip(".")
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if entry == "*":
            return True
        name, want_port = _split_port(entry)
        name = name.lstrip(".").strip("[]")
        if not name or (want_port is not None and want_port != port):
            continue
        if host == name or host.endswith("." + name) or _in_network(host, name):
            return True
    return False


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6]:port
        name, _, rest = entry[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif entry.count(":") == 1:  # name:port (a bare v6 address has several colons)
        name, _, port_text = entry.partition(":")
    else:
        return entry, None
    return name, int(port_text) if port_text.isdecimal() else None  # not isdigit: "²"


def _in_network(host: str, name: str) -> bool:
    try:
        return ipaddress.ip_address(host) in ipaddress.ip_network(name, strict=False)
    except ValueError:  # a name, not an address or network
        return False


def _first_set(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` that is set and not blank, lower case before upper: (name, value)."""
    for name in names:
        for spelled in (name, name.upper()):
            value = env.get(spelled, "").strip()
            if value:
                return spelled, value
    return None


def _parse(variable: str, value: str) -> Proxy:
    # A bare host:port means an HTTP proxy, as it does for curl.
    try:
        parts = urlsplit(value if "://" in value else f"http://{value}")
    except ValueError:  # an IPv6 bracket left open: `http://[::1`
        parts = urlsplit("http://")
    if parts.scheme != "http":
        raise SpecError(f"environment variable {variable} names a {parts.scheme} proxy "
                        f"({parts.scheme}://{parts.hostname or ''}...); shardrun connects "
                        "through HTTP proxies only (http://host:port): change or unset it, or "
                        "add the endpoint's host to no_proxy")
    try:
        port = parts.port or 80
    except ValueError:
        port = -1
    if not parts.hostname or port < 0:
        raise SpecError(f"environment variable {variable} does not name a proxy as "
                        "http://host:port (its host or port is missing or not valid)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    authorization = None
    if parts.username is not None:
        user_pass = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(user_pass.encode()).decode("ascii")
    return Proxy(f"http://{host}:{port}", variable, authorization)
