"""How the words of a sync travel between its parties (``transport.signals``): through each group's
TCPStore, or over plain TCP sockets - each member's doorbell, and the bells that ring it.

An armed sync starts on a word: the driver tells the trainer's push and the engines' receives that
the version was announced (or called off); a push that is not armed tells the engines it is
sending. Through the group's TCPStore a word wakes two threads - the store's server thread in rank
0's process, then the client waiting on its own connection - where through a socket it wakes one:
the waiter itself, blocked on its doorbell's connections. In armed syncs side by side (``disagg
bench vllm-sync --signals store,socket``, 2026-12-02) the trainer's push had the driver's word 0.23
ms after the announce against 0.34 through the store on an H200's host, 0.45 against 0.90 on a
2-core machine, and the engine's worker 0.28 against 0.41, 0.65 against 1.53.

Each member of a group listens on a doorbell (a port of its own, published in the group's store as
``bell/<rank>`` before the rendezvous). Rank 0 connects to every other member's doorbell as the
group is made: its words go down that connection, and that connection's end tells a waiting member
that rank 0 is gone, as the store's loss did. A non-member (the driver) connects with ``Bells`` too.
A word is one line, ``key value``; a word that comes while another key is waited for is kept for a
later wait.

``StoreSignals`` and ``BellSignals`` are the driver's (no member of the groups) two ways to say a
word to every member. This module never imports vLLM or Ray and never touches a process group.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore

from disagg.errors import TransportError, brief

SIGNALS = ("store", "socket")  # transport.signals
_KEPT_WORDS = 64  # words kept for later waits (each sync's keys are new: arm/N, go/N)
HELLO = "hello"  # a connection's first word: who rings (its value; "rank 0" for a group's rank 0)


class BellError(RuntimeError):
    """A doorbell's wait failed: ``gone`` says whether the group's rank 0 hung up (else: timed out)."""

    def __init__(self, message: str, gone: bool) -> None:
        super().__init__(message)
        self.gone = gone


def encode(words: dict[str, str]) -> bytes:
    """``words`` as lines ``key value``; ``ValueError`` for a key with a space or either with a line break."""
    lines = []
    for key, value in words.items():
        if not key or any(c in key for c in " \r\n") or any(c in value for c in "\r\n"):
            raise ValueError(f"a word's key must be one token and its value one line: {key!r} -> {value!r}")
        lines.append(f"{key} {value}\n")
    return "".join(lines).encode()


class Doorbell:
    """One member's doorbell: a listening socket and the connections that ring it. ``wait(key)``
    blocks on them (one thread at a time) until a word for ``key`` comes."""

    def __init__(self, address: str) -> None:
        self._listener = socket.create_server((address, 0), family=_family(address), backlog=128)
        self._listener.setblocking(False)
        self.address = (address, int(self._listener.getsockname()[1]))
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        # close() in another thread wakes a wait through this pair (a socket closed under a select wakes nothing)
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        self._pending: dict[socket.socket, bytearray] = {}  # connection -> bytes short of a line
        self._who: dict[socket.socket, str] = {}
        self._said: OrderedDict[str, str] = OrderedDict()
        self._rank0_gone = False
        self._closed = False
        self._lock = threading.Lock()

    def wait(self, key: str, timeout_s: float, progress: Callable[[float], None] | None = None,
             progress_s: float = 10.0) -> str:
        """The value of the word ``key`` (taken: a second wait for it waits again). ``progress(waited_s)``
        every ``progress_s`` while waiting. ``BellError`` on the timeout, or at once when rank 0's
        connection ends with no such word (``gone``)."""
        with self._lock:
            t0 = time.monotonic()
            deadline, next_log = t0 + timeout_s, t0 + progress_s
            while key not in self._said:
                if self._closed:  # by another thread meanwhile (its group destroyed), or before
                    raise BellError(f"this member's doorbell was closed while waiting for {key!r}", gone=False)
                if self._rank0_gone:
                    raise BellError("rank 0 hung up (its process ended or left the group)", gone=True)
                now = time.monotonic()
                if now >= deadline:
                    raise BellError(f"no word {key!r} within {timeout_s:.1f} s", gone=False)
                if now >= next_log:
                    if progress is not None:
                        progress(now - t0)
                    next_log = now + progress_s
                # close() rings the socket pair and takes the lock before closing anything: no socket
                # or selector closes under this select
                for ready, _ in self._selector.select(min(deadline, next_log) - now):
                    self._take(ready.fileobj)
            return self._said.pop(key)

    def _take(self, sock) -> None:
        if sock is self._wake:  # close() rang: the wait's loop sees it closed
            return
        if sock is self._listener:
            while True:
                try:
                    conn, _ = self._listener.accept()
                except BlockingIOError:
                    return
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setblocking(False)
                self._pending[conn] = bytearray()
                self._selector.register(conn, selectors.EVENT_READ, None)
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        buf = self._pending[sock]
        buf += data
        *lines, rest = buf.split(b"\n")
        self._pending[sock] = bytearray(rest)
        for line in lines:
            key, _, value = line.decode(errors="replace").partition(" ")
            if key == HELLO and sock not in self._who:
                self._who[sock] = value
                continue
            self._said[key] = value
            self._said.move_to_end(key)
            while len(self._said) > _KEPT_WORDS:
                self._said.popitem(last=False)
        if not data:  # the ringer hung up (the words it sent are taken above)
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        if self._who.pop(sock, None) == "rank 0":
            self._rank0_gone = True
        self._pending.pop(sock, None)
        self._selector.unregister(sock)
        sock.close()

    def close(self) -> None:
        """Hang up every ringer and stop listening (twice is once). A wait in another thread wakes at
        once and ends with ``BellError``; this returns once it has."""
        if self._closed:
            return
        self._closed = True
        try:
            self._waker.send(b"\0")
        except OSError:
            pass
        with self._lock:  # the waiting thread, if any, has left
            for sock in list(self._pending):
                self._drop(sock)
            self._selector.close()
            for sock in (self._listener, self._wake, self._waker):
                sock.close()


class Bells:
    """Connections to doorbells (``(host, port)`` each), opened once; ``ring`` sends words down each.
    ``who``: the hello each doorbell files the connection under ("rank 0": a waiting member takes
    its end for rank 0's)."""

    def __init__(self, addresses: list[tuple[str, int]], who: str, timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._socks: list[tuple[tuple[str, int], socket.socket | None]] = []
        try:
            for addr in addresses:
                sock = socket.create_connection(addr, timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(encode({HELLO: who}))
                self._socks.append((addr, sock))
        except OSError:
            self.close()
            raise

    def ring(self, words: dict[str, str]) -> list[str]:
        """Send ``words`` to every doorbell, one write each; what failed, one line per doorbell (it
        hung up: its process died). A failed connection is not rung again."""
        payload, failed = encode(words), []
        with self._lock:
            for i, (addr, sock) in enumerate(self._socks):
                if sock is None:
                    failed.append(f"{addr[0]}:{addr[1]}: hung up before")
                    continue
                try:
                    sock.sendall(payload)
                except OSError as e:
                    sock.close()
                    self._socks[i] = (addr, None)
                    failed.append(f"{addr[0]}:{addr[1]}: {e}")
        return failed

    def close(self) -> None:
        with self._lock:
            for _, sock in self._socks:
                if sock is not None:
                    sock.close()
            self._socks = []


class StoreSignals:
    """Signals into transport groups' stores from a process that is no member of them (the driver):
    one client connection to each group's store, keys under the group's prefix as
    ``TransportGroup.signal`` sets them, so ``await_signal`` on a member returns the value. Made once
    per group epoch; a set is one round trip to the store (its host's process: the trainer rank)."""

    def __init__(self, endpoints: list[tuple[str, int, str]], timeout_s: float) -> None:
        self._stores = []
        for host, port, name in endpoints:
            try:
                store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=timeout_s))
            except RuntimeError as e:
                raise TransportError(f"group {name!r}: cannot reach the store at {host}:{port} ({brief(e)})") from e
            self._stores.append((name, PrefixStore(name, store)))

    def close(self) -> None:
        self._stores = []

    def signal(self, words: dict[str, str]) -> list[str]:
        """Set each key of ``words`` to its value in every group's store, one round trip per store;
        what failed, one line per group (a store that is gone: its host process died)."""
        failed = []
        keys, values = list(words), list(words.values())
        for name, store in self._stores:
            try:
                store.multi_set(keys, values)
            except RuntimeError as e:
                failed.append(f"group {name!r}: {brief(e)}")
        return failed


class BellSignals:
    """``StoreSignals``' words rung on every member's doorbell instead (``transport.signals=socket``):
    the addresses read from each group's store once per group epoch (``bell/<rank>``), one connection
    to each doorbell kept open; a word is one write to each, no store hop."""

    def __init__(self, endpoints: list[tuple[str, int, str]], world_size: int, timeout_s: float) -> None:
        self._bells: list[tuple[str, Bells]] = []
        for host, port, name in endpoints:
            try:
                store = PrefixStore(name, TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                   timeout=timedelta(seconds=timeout_s)))
                addresses = [parse_address(store.get(f"bell/{r}").decode()) for r in range(world_size)]
                self._bells.append((name, Bells(addresses, "driver", timeout_s)))
            except (RuntimeError, OSError) as e:
                self.close()
                raise TransportError(f"group {name!r}: cannot reach its members' doorbells through the store at "
                                     f"{host}:{port} ({brief(e)})") from e

    def signal(self, words: dict[str, str]) -> list[str]:
        """Ring ``words`` on every member of every group; what failed, one line per member."""
        return [f"group {name!r}: {failed}" for name, bells in self._bells for failed in bells.ring(words)]

    def close(self) -> None:
        for _, bells in self._bells:
            bells.close()
        self._bells = []


def driver_signals(endpoints: list[tuple[str, int, str]], world_size: int, timeout_s: float,
                   signals: str) -> "StoreSignals | BellSignals":
    """The driver's way to say a word to every member of ``endpoints``' groups (``transport.signals``)."""
    if signals not in SIGNALS:
        raise ValueError(f"transport.signals must be one of {SIGNALS}, got {signals!r}")
    if signals == "socket":
        return BellSignals(endpoints, world_size, timeout_s)
    return StoreSignals(endpoints, timeout_s)


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (as a doorbell is published; an IPv6 host keeps its colons) -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host, int(port)


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET
