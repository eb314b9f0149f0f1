"""A TCP forwarder on 127.0.0.1 that a test can cut: a partition of one
client from a server that stays up for everyone else.

``TcpProxy(target_port)`` listens on its own free port and forwards every
connection to the target. ``cut()`` drops the connections it carries and
then accepts new ones without forwarding a byte (a black hole: the client's
requests go unanswered until its own timeout, as across a dead link);
``restore()`` forwards again. ``close()`` stops it. ``delay`` holds every
chunk a client sends that many seconds before forwarding it: a slow link
(or a slow server), not a dead one. Threads only: the test process owns it,
and it is stopped with the test.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

HOST = "127.0.0.1"


class TcpProxy:
    def __init__(self, target_port: int, *, delay: float = 0.0) -> None:
        self.target_port = target_port
        self.delay = delay
        self._listener = socket.create_server((HOST, 0))
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []  # every socket this proxy holds, to drop on cut/close
        self._cut = False
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            self._drop()

    def restore(self) -> None:
        with self._lock:
            self._cut = False
            self._drop()  # the black-holed connections: the client reconnects through a live one

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()
        self._thread.join(5.0)
        self._listener.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drop(self) -> None:
        for sock in self._open:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._open.clear()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                if self._closed:
                    client.close()
                    return
                self._open.append(client)
                if self._cut:
                    continue  # held open, never read: a black hole
            try:
                upstream = socket.create_connection((HOST, self.target_port), timeout=2.0)
            except OSError:
                with self._lock:
                    if client in self._open:
                        self._open.remove(client)
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.append(upstream)
            for src, dst, delay in ((client, upstream, self.delay), (upstream, client, 0.0)):
                threading.Thread(target=self._pump, args=(src, dst, delay), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
