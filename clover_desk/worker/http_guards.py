"""What the HTTP server (:mod:`clover_desk.worker.server`) checks before any work, and how it holds up against
slow or many clients.

* :class:`RequestPolicy`: whom a request may come from. ``Host`` must name this machine as a browser's page on
  this machine would (a loopback name or address), the address the server is bound to (any address when it is bound
  to every interface: an address is never a rebound name), or a name given with ``--allowed-hosts``; that defeats
  DNS rebinding (a page at ``rebind.attacker.example`` whose name later resolves to 127.0.0.1 sends that name). A
  request with an ``Origin`` (a browser's page) must come from an allowed origin: loopback pages, plus
  ``--allowed-origins`` (``*``: any); CORS preflights are answered for those only.
* :class:`ConnectionGuard`: uvicorn's HTTP/1.1 protocol with deadlines and a cap. uvicorn arms its keep-alive timer
  only after a first answer and resets it on every byte, so a client that sends a header a byte at a time holds its
  connection forever, and its ``limit_concurrency`` answers 503 to everything, ``/health`` included. Here each
  connection must complete its request headers within ``header_timeout_s`` of opening (or of its last answer), and
  past ``max_connections`` open ones a new connection pushes out the oldest one that has not sent a whole request
  (a connection with a request in progress is never dropped; when all are, the new one is).
* :class:`HangupLog`: a client that goes away early is one short line, at most one a few seconds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

try:
    import resource  # POSIX: the open-files limit
except ImportError:  # Windows: no such limit to raise
    resource = None  # type: ignore[assignment]
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
access_log = logging.getLogger("clover_desk.access")

HEADER_TIMEOUT_S = 10.0  # a connection's request line and headers, from its opening or its last answer
BODY_TIMEOUT_S = 30.0  # a request's body, from its headers
MAX_CONNECTIONS = 256
MAX_IN_FLIGHT = 64  # requests being answered (waiting for the engine included); /health is not counted
FD_RESERVE = 128  # file descriptors kept for everything but client connections (model files, pipes, logs)
HANGUP_LOG_EVERY_S = 10.0

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def _is_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine only."""
    host = host.strip().lower().rstrip(".")
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    address = _is_ip(host)
    return address is not None and address.is_loopback


def is_wildcard(host: str) -> bool:
    address = _is_ip(host)
    return address is not None and address.is_unspecified


def split_host(value: str) -> str:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``), lower case; "" when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[1:end], value[end + 1:]
        return host if end > 0 and (not rest or (rest[0] == ":" and rest[1:].isdigit())) else ""
    if value.count(":") > 1:  # a bare IPv6 address (not valid in Host, but unambiguous)
        return value if _is_ip(value) else ""
    host, _, port = value.partition(":")
    return host.rstrip(".") if not port or port.isdigit() else ""


def normalize_origin(value: str) -> str:
    """An origin as ``scheme://host[:port]`` (lower case), or ValueError naming what is wrong. ``*`` stays ``*``."""
    value = value.strip()
    if value == "*":
        return value
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query \
            or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{value!r} is not an origin: use scheme://host[:port], e.g. https://app.example.com, or *")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{value!r} has a bad port") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def check_host_name(value: str) -> str:
    """A ``--allowed-hosts`` entry (a name, an address or ``*``), lower case; ValueError when it is not one."""
    name = value.strip().lower().rstrip(".")
    if name == "*" or _is_ip(name) is not None:
        return name.strip("[]")
    labels = name.removeprefix("*.").split(".")
    if not name or not all(label and len(label) <= 63 and label.replace("-", "").isalnum() for label in labels):
        raise ValueError(f"{value!r} is not a host name or address (e.g. llm.lan, 192.168.1.20, *.lan or *)")
    return name


@dataclass(frozen=True)
class RequestPolicy:
    """Which ``Host`` and ``Origin`` values the server answers (see the module's docstring)."""

    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # names or addresses (already checked), "*.suffix" or "*"
    allowed_origins: tuple[str, ...] = ()  # normalized origins or "*"

    @classmethod
    def make(cls, bound_host: str, hosts: Iterable[str] = (), origins: Iterable[str] = ()) -> RequestPolicy:
        """ValueError naming the first bad entry."""
        return cls(bound_host.strip("[]").lower(), tuple(check_host_name(h) for h in hosts),
                   tuple(normalize_origin(o) for o in origins))

    def host_allowed(self, header: str | None) -> bool:
        if header is None:
            return False
        host = split_host(header)
        if not host:
            return False
        if is_loopback(host) or host == self.bound_host or "*" in self.allowed_hosts:
            return True
        if is_wildcard(self.bound_host) and _is_ip(host) is not None:
            return True  # bound to every interface: any of this machine's addresses (an address is not rebound)
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.allowed_hosts)

    def origin_allowed(self, origin: str) -> bool:
        if "*" in self.allowed_origins:
            return True
        try:
            normal = normalize_origin(origin)
        except ValueError:
            return False  # "null" (a sandboxed page, a file), or garbage
        if normal in self.allowed_origins:
            return True
        return is_loopback(urlsplit(normal).hostname or "")

    def describe(self) -> str:
        """One line for people: what the server accepts."""
        hosts = "any name" if "*" in self.allowed_hosts else ", ".join(
            ["loopback names", *(["this machine's addresses"] if is_wildcard(self.bound_host) else
                                 [] if is_loopback(self.bound_host) else [self.bound_host]),
             *self.allowed_hosts])
        origins = "any page" if "*" in self.allowed_origins else ", ".join(
            ["pages on this machine", *self.allowed_origins])
        return f"Host: {hosts}; browser origins: {origins}; POST bodies: application/json only"


# ---------------------------------------------------------------------------------------------------------------
# connections


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as servers do); returns the soft limit (0
    where there is no such limit: Windows)."""
    if resource is None:
        return 0
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return int(soft)
    except (ValueError, OSError):
        return 1024


class ConnectionGuard:
    """The open connections of one server, oldest first, with their header deadlines (see the module's
    docstring); :meth:`protocol` is the uvicorn protocol class that reports to it."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS, header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        self.max_connections = max(4, min(max_connections, raise_open_file_limit() - FD_RESERVE))
        self.header_timeout_s = header_timeout_s
        self._open: OrderedDict[Any, None] = OrderedDict()
        self.dropped = 0  # connections pushed out by newer ones, or refused
        self.timed_out = 0  # connections closed at their header deadline

    @property
    def open_count(self) -> int:
        return len(self._open)

    def protocol(self) -> type[H11Protocol]:
        """An :class:`H11Protocol` subclass bound to this guard (uvicorn's ``http`` setting)."""
        guard = self

        class GuardedH11Protocol(_GuardedProtocol):
            pass

        GuardedH11Protocol.guard = guard
        return GuardedH11Protocol

    def opened(self, conn: _GuardedProtocol) -> None:
        self._open[conn] = None
        while len(self._open) > self.max_connections:
            victim = next((c for c in self._open if c is not conn and c.awaiting_request), conn)
            self.dropped += 1
            self.closed(victim)
            victim.drop("too many connections")
            if victim is conn:
                log.warning("refused a connection: %d are open, each with a request in progress",
                            self.max_connections)
                return

    def closed(self, conn: _GuardedProtocol) -> None:
        self._open.pop(conn, None)


class _GuardedProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a header deadline, reporting to its :class:`ConnectionGuard`."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()
        self.guard.opened(self)

    @property
    def awaiting_request(self) -> bool:
        """No request in progress: between requests, or its headers not complete yet."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.guard.header_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()  # type: ignore[union-attr]
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.awaiting_request and not self.transport.is_closing():
            self.guard.timed_out += 1
            self.drop("no whole request in time")

    def drop(self, why: str) -> None:
        log.debug("closing a connection from %s: %s", self.client, why)
        self._disarm()
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.awaiting_request:
            self._disarm()  # a request came whole: the body has its own deadline (the server's)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.closed(self)
        super().connection_lost(exc)


# ---------------------------------------------------------------------------------------------------------------
# log lines


class HangupLog:
    """"client X hung up during METHOD PATH": one line, then at most one every ``every_s`` seconds (the ones in
    between are counted in the next)."""

    def __init__(self, every_s: float = HANGUP_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last = -1e9
        self._quiet = 0

    def note(self, client: str, method: str, path: str) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._quiet += 1
            return
        more = f" (and {self._quiet} more since the last such line)" if self._quiet else ""
        self._last, self._quiet = now, 0
        access_log.info("client %s hung up during %s %s%s", client, method, path, more)


def log_access(client: str, method: str, path: str, status: int, tokens: int | None, seconds: float) -> None:
    """One line per request: who, what, the status, tokens written, time taken (never the prompt)."""
    access_log.info("%s %s %s %d %s %.3f s", client, method, path, status,
                    "-" if tokens is None else f"{tokens} tokens", seconds)
