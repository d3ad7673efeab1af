"""Which browser pages may use the server, as Ollama decides it: pages of a local origin (localhost,
127.0.0.1, [::1] or 0.0.0.0, at any port, http or https) by default, any other origin only where
``--allowed-origins`` names it (``*``: every origin). A request from any other origin is refused with a
403 before the app reads it, preflight or not: a "simple" ``text/plain`` POST from a page generates
nothing. On a loopback bind a request whose ``Host`` is not local is refused too (a DNS-rebinding page
is same-origin and sends no ``Origin`` on a GET)."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable

LOCAL_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d+)?"
LOCAL_HOST_NAMES = ("localhost",)


def origin_allowed(origin: str, allowed_origins: Iterable[str]) -> bool:
    """A local origin, or one of ``allowed_origins`` (``*``: any)."""
    allowed = set(allowed_origins)
    return "*" in allowed or origin in allowed or re.fullmatch(LOCAL_ORIGIN, origin) is not None


def is_loopback(bind_host: str) -> bool:
    """The server listens on loopback alone (a page can reach it only through this machine's names)."""
    if bind_host in LOCAL_HOST_NAMES:
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_local(host: str, machine: str = socket.gethostname().lower()) -> bool:
    """``host`` (a ``Host`` header) names this machine: localhost (or a name under .localhost), this machine's
    name, or an address of loopback, a private network or any (0.0.0.0), at any port. A name a remote DNS
    server answers (a rebinding page's) is none of these."""
    name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
    name = name.lower().rstrip(".")
    if name in ("", *LOCAL_HOST_NAMES) or name.endswith(".localhost") or name == machine:
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_unspecified


class LocalGuard:
    """ASGI middleware in front of ``app``: a request from a page of an origin not allowed, or (``bind_host``
    loopback) with a ``Host`` that is not local, gets ``refuse(path, message)``'s reply, a 403, and ``app``
    never sees it."""

    def __init__(self, app, allowed_origins: Iterable[str], bind_host: str, refuse: Callable):
        self.app, self.allowed_origins, self.refuse = app, tuple(allowed_origins), refuse
        self.check_host = is_loopback(bind_host)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (message := self.refusal(scope)):
            await self.refuse(scope["path"], message)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> str | None:
        headers = {name: value.decode("latin-1") for name, value in scope["headers"] if name in (b"origin", b"host")}
        host, origin = headers.get(b"host"), headers.get(b"origin")
        if self.check_host and host is not None and not host_local(host):
            return f"Host {host[:100]} is not this machine's: the server listens on loopback (--host)"
        if origin is not None and not origin_allowed(origin, self.allowed_origins):
            return (
                f"origin {origin[:100]} may not use this server; pages of local origins may "
                "(start it with --allowed-origins naming this one to allow it)"
            )
        return None
