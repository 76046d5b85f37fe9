"""Importing aiohttp without loading the system's CA store, for processes that never use it."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator


@contextlib.contextmanager
def ca_store_deferred() -> Iterator[list[ssl.SSLContext]]:
    """Within: SSL contexts skip loading the system's CA store; yields the contexts that did.

    aiohttp builds two default SSL contexts when it is imported, each loading every system CA
    certificate: about 0.04 CPU-s, a sixth of a launcher's imports. The shards of a run against
    a plain `http://` endpoint never open a TLS connection (the client follows no redirects),
    nor does the simulator (a server), so neither has a use for them. A context without CA
    certificates verifies no server at all: a TLS connection made with one fails with a
    certificate error, never succeeds unverified. Calling `set_default_verify_paths()` on the
    yielded contexts loads what was skipped.
    """
    skipped: list[ssl.SSLContext] = []
    name = "set_default_verify_paths"
    own = ssl.SSLContext.__dict__.get(name)  # None: inherited from the C base class

    def skip(context: ssl.SSLContext) -> None:
        skipped.append(context)

    setattr(ssl.SSLContext, name, skip)
    try:
        yield skipped
    finally:
        if own is None:
            delattr(ssl.SSLContext, name)
        else:
            setattr(ssl.SSLContext, name, own)
