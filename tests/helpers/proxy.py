"""A small threaded TCP proxy on 127.0.0.1 for simulating link failures between one MQTT client and the broker.

The client connects to ``proxy.port`` instead of the broker's port. The proxy can forward, stall (hold every byte
in both directions while the sockets stay open: a silent link), cut every connection (close both sockets: a
dropped link), and cut once a given number of client→broker bytes went through (a link that dies mid-upload).
After a cut the proxy keeps listening, so the client's reconnect goes through again (unless ``refuse`` is set).
"""

from __future__ import annotations

import select
import socket
import threading
import time

BUFFER_BYTES = 64 * 1024
POLL_S = 0.05  # how often a pump rechecks the stall and closing flags
WAIT_S = 10.0  # default wait of wait_for_cut / wait_for_connections


class _Link:
    """One proxied connection: the client's socket and the broker's, closed together."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.closed = threading.Event()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target_host``:``target_port``; a context manager.

    Counters: ``up_bytes`` (client→broker) and ``down_bytes`` (broker→client) forwarded in total, ``accepted``
    connections, ``cuts`` performed. Thread-safe; every method returns at once.
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port: int = self.listener.getsockname()[1]
        self.up_bytes = 0
        self.down_bytes = 0
        self.accepted = 0
        self.cuts = 0
        self.refuse = False  # while set, new connections are closed at once (the link stays down)
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._cut_at: int | None = None  # cut when up_bytes reaches this
        self._cut_done = threading.Event()
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop, "proxy-accept")

    @property
    def url(self) -> str:
        """mqtt://127.0.0.1:<proxy port>."""
        return f"mqtt://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------------------------------ controls

    def stall(self) -> None:
        """Stop forwarding in both directions; the sockets stay open, so neither side notices (but keep-alive)."""
        self._forwarding.clear()

    def resume(self) -> None:
        """Forward again what was held and what comes next."""
        self._forwarding.set()

    def cut(self) -> int:
        """Close both sockets of every open connection (counted in `cuts`); returns how many were cut."""
        with self._lock:
            self.cuts += 1
        n = self._close_links()
        self._cut_done.set()
        return n

    def _close_links(self) -> int:
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
        return len(links)

    def cut_after(self, up_bytes: int) -> None:
        """Cut every connection once ``up_bytes`` more client→broker bytes went through (exactly that many)."""
        with self._lock:
            self._cut_done.clear()
            self._cut_at = self.up_bytes + up_bytes

    def wait_for_cut(self, timeout: float = WAIT_S) -> bool:
        """True once a cut happened (since the last cut_after), False after ``timeout``."""
        return self._cut_done.wait(timeout)

    def wait_for_connections(self, n: int, timeout: float = WAIT_S) -> bool:
        """True once ``n`` connections were accepted in total, False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.accepted < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S / 5)
        return True

    def close(self) -> None:
        """Stop listening and cut everything."""
        self._closing = True
        self._forwarding.set()
        try:
            self.listener.close()
        except OSError:
            pass
        self._close_links()
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ the pumps

    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self.refuse or self._closing:
                conn.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                conn.close()  # broker down: the client sees its connection closed, as it would without us
                continue
            upstream.settimeout(None)
            link = _Link(conn, upstream)
            with self._lock:
                self._links.append(link)
                self.accepted += 1
            self._spawn(self._pump, "proxy-up", link, conn, upstream, True)
            self._spawn(self._pump, "proxy-down", link, upstream, conn, False)

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket, up: bool) -> None:
        while not link.closed.is_set():
            if not self._forwarding.wait(POLL_S):
                continue
            try:
                ready, _, _ = select.select([src], [], [], POLL_S)
                if not ready:
                    continue
                if not self._forwarding.is_set():
                    continue  # stalled while we waited: leave the bytes in the kernel buffer
                data = src.recv(BUFFER_BYTES)
            except (OSError, ValueError):
                break
            if not data:
                break
            if up and not self._forward_up(link, dst, data):
                return
            if not up:
                try:
                    dst.sendall(data)
                except OSError:
                    break
                with self._lock:
                    self.down_bytes += len(data)
        link.close()

    def _forward_up(self, link: _Link, dst: socket.socket, data: bytes) -> bool:
        """Send client→broker bytes, honouring an armed cut_after; False once the link is gone."""
        with self._lock:
            hit = self._cut_at is not None and self._cut_at - self.up_bytes <= len(data)
            if hit:
                data, self._cut_at = data[: max(self._cut_at - self.up_bytes, 0)], None
            self.up_bytes += len(data)
        try:
            if data:
                dst.sendall(data)
        except OSError:
            link.close()
            return False
        if hit:
            self.cut()
            return False
        return True
