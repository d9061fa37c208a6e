"""The HTTP server the window asked the worker for: the ``serve`` command (sent again to a restarted worker until
``stop_server``), and what the worker's ``serving`` record said (its URL, whom it answers). Standard library only."""

from __future__ import annotations

from typing import Any


class ServeRequest:
    """Serving as asked and as the worker reports it."""

    def __init__(self) -> None:
        self.command: dict[str, Any] | None = None  # the serve command asked for (sent again after a restart)
        self.url: str | None = None  # the server's base URL while the worker serves
        self._policy = ""  # whom the server answers (its "serving" record's policy line)

    @property
    def policy(self) -> str:
        """Whom the server answers, one line; "" while it does not serve."""
        return self._policy if self.url else ""

    def ask(self, host: str, port: int, api_key: str | None) -> dict[str, Any]:
        """Serving is asked for: the command to send (kept, to send again after a restart)."""
        self.command = {"cmd": "serve", "host": host, "port": int(port), "api_key": api_key or None}
        return dict(self.command)

    def again(self) -> dict[str, Any] | None:
        """The command a fresh worker gets when serving was on (None: it was not)."""
        return None if self.command is None else dict(self.command)

    def listening(self, record: dict[str, Any]) -> str:
        """The worker's ``serving`` record: the URL it listens at."""
        self.url = str(record.get("url") or "")
        self._policy = str(record.get("policy") or "")
        return self.url

    def stopped(self) -> bool:
        """The server stopped (or went with its worker); whether it was listening."""
        was, self.url = self.url is not None, None
        return was

    def refused(self, kind: str) -> None:
        """``serve`` failed: nothing to start again after a restart (unless it was already serving)."""
        if kind != "AlreadyServing":
            self.command = None
