"""Redacting secrets from URLs before they are printed or logged.

Use `redact_url` wherever a URL that may carry a password (a Redis URL above
all: `redis://:PASSWORD@host:6379/0`, `rediss://user:PASSWORD@host/0`) reaches a
log line, a banner, an error message or a state file. Children get such URLs
through the environment (DISTSERVE_REDIS_URL), never through argv, which any
local user can read with `ps`.
"""

from __future__ import annotations

import urllib.parse

MASK = "***"


def redact_url(url: str) -> str:
    """The URL with its password (and any `password=` query value) replaced by ***; unparsable input
    is masked entirely rather than echoed."""
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hostport = netloc.rpartition("@")
            user = userinfo.partition(":")[0]
            netloc = f"{user}:{MASK}@{hostport}"
        query = urllib.parse.urlencode(
            [(k, MASK if k.lower() == "password" else v) for k, v in urllib.parse.parse_qsl(parts.query)], safe="/*")
        return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return MASK
