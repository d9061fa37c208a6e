"""A loopback listener for the preview's sandbox tests: proof that a page reached nothing on the network."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

Address = tuple[str, int]


class LoopbackListener:
    """Accepts TCP connections on a free 127.0.0.1 port and counts them (then hangs up); counts UDP datagrams to the
    same port. Any entry in ``accepted`` or ``datagrams`` means a page got out."""

    def __init__(self, backlog: int = 64) -> None:
        self._tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind(("127.0.0.1", 0))
        self._tcp.listen(backlog)
        self._tcp.settimeout(0.1)
        self.port: int = self._tcp.getsockname()[1]
        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._udp.bind(("127.0.0.1", self.port))
        self._udp.settimeout(0.1)
        self.accepted: list[Address] = []
        self.datagrams: list[Address] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(self._accept,), name="loopback-tcp", daemon=True),
                         threading.Thread(target=self._loop, args=(self._receive,), name="loopback-udp", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _accept(self) -> None:
        conn, addr = self._tcp.accept()
        self.accepted.append(addr)
        conn.close()

    def _receive(self) -> None:
        _, addr = self._udp.recvfrom(4096)
        self.datagrams.append(addr)

    def _loop(self, step: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                step()
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._tcp.close()
        self._udp.close()
