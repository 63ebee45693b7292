"""A dedicated process group for weight sync, outside torch's default group.

The trainer and the rollout workers live in different processes (often different
Ray jobs) that must exchange weights without joining one global world, so each
sync group is built by hand: a ``TCPStore`` hosted by rank 0 under a
``PrefixStore`` named after the group, then a ``ProcessGroupGloo`` or
``ProcessGroupNCCL`` on top. Every wait here is bounded: the rendezvous and every
collective raise ``TransportError`` naming the group, the op and the peers
instead of hanging.

This module must never initialise torch's default process group (it would claim
the process for one world) and never import vLLM or Ray.

Failure behaviour measured with gloo (torch 2.13), which shapes the code below:
a peer that exits makes every rank's next op fail at once ("Connection closed
by peer"); a peer that is alive but never enters the op makes the others fail
only when gloo's own per-op timeout fires (a send waits for the receiver to post
its buffer, so even a tiny broadcast does not complete early). ``Work.wait(t)``
raising does not cancel the op, ``abort()`` does not stop it, and dropping the
group blocks until it ends, so gloo's timeout is set equal to ours and a failed
group is released at once: its peers then fail fast instead of timing out.

With NCCL (torch 2.11, 2 x H200) a small broadcast completes on the root even
when no receiver takes part (NCCL buffers it), a large one times out here; the
group is then aborted, which keeps NCCL's watchdog from killing the process.
NCCL's heartbeat thread polls the store every second, so rank 0 should destroy
its group last.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from disagg.errors import TransportError
from disagg.errors import brief as _brief  # (one name for it in this module's many messages)
from disagg.transport.signals import SIGNALS, BellError, Bells, Doorbell, parse_address

log = logging.getLogger(__name__)

# A wait longer than this logs that it is still waiting, then keeps waiting.
_PROGRESS_LOG_S = 10.0
# Our wait outlasts gloo's own op timeout by this much, so gloo's error (which
# says whether a send or a recv stalled) is the one reported.
_WAIT_GRACE_S = 0.5
# NCCL's watchdog kills the process when its timeout fires; ours must come first.
_NCCL_WATCHDOG_MARGIN_S = 60.0
# Every rank stamps a heartbeat key in the store this often; a failed op names the
# ranks whose stamp went stale (a dead peer), which gloo and NCCL errors do not.
_HEARTBEAT_S = 0.5
_STALE_S = 3 * _HEARTBEAT_S
# Rank 0 retries hosting its store on a port in use for this long before it fails.
_BIND_RETRY_S = 5.0
# Longest nap between completion polls of an NCCL op.
_POLL_MAX_S = 5e-5


class _Heartbeat(threading.Thread):
    """Stamps ``hb/<rank>`` with the time every _HEARTBEAT_S until stopped."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        super().__init__(daemon=True, name=f"disagg-heartbeat-{rank}")
        self._store, self._rank, self._stop = store, rank, threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.set(f"hb/{self._rank}", repr(time.time()))
            except RuntimeError:  # the store (rank 0) is gone: nothing left to stamp
                return
            self._stop.wait(_HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()


# Ports handed out by this process: two groups set up back to back never get the same one.
_HANDED_PORTS: set[int] = set()
# Where a store's port is picked: above Ray's worker ports (10002-19999 by default) and outside the
# kernel's ephemeral range, which outgoing connections draw from (see pick_free_port).
_STORE_PORT_FLOOR = 20000


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local port of outgoing connections (Linux; its default elsewhere)."""
    try:
        lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _port_candidates() -> list[int]:
    lo, hi = _ephemeral_ports()
    ports = [p for p in range(_STORE_PORT_FLOOR, 65536) if not lo <= p <= hi and p not in _HANDED_PORTS]
    random.shuffle(ports)
    return ports


def pick_free_port(host: str) -> int:
    """A TCP port free on ``host`` right now, for rank 0 to host the store on.

    The port is taken outside the kernel's ephemeral range. Inside it, a peer that polls
    ``host:port`` before the store is up (``_await_store``) can be given that very port as its
    own local port and connect to itself (TCP simultaneous open), which holds the port: rank 0
    then failed with EADDRINUSE (seen on an H200 machine, 2026-11-24). Ray's agents take
    ephemeral ports too. Falls back to any free port when the range leaves none.
    """
    family, kind, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    for port in _port_candidates()[:64]:
        with socket.socket(family, kind) as s:
            try:
                s.bind((addr[0], port, *addr[2:]))
            except OSError:
                continue
        _HANDED_PORTS.add(port)
        return port
    with socket.socket(family, kind) as s:
        s.bind(addr)
        port = int(s.getsockname()[1])
    _HANDED_PORTS.add(port)
    return port


def _self_connected(sock: socket.socket) -> bool:
    """Whether ``sock`` is connected to itself (its local address is its peer's), not to a listener."""
    try:
        return sock.getsockname()[:2] == sock.getpeername()[:2]
    except OSError:
        return False


def _local_address(host: str, port: int) -> str:
    """The local address on the route to ``host``: what peers can reach this rank at."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)  # UDP: picks a route, sends nothing
        return str(s.getsockname()[0])


class TransportGroup:
    """One weight-sync group: blocking, timed collectives and byte counters."""

    def __init__(self, *, pg: dist.ProcessGroup, store: TCPStore, name: str, rank: int,
                 world_size: int, backend: str, device: torch.device, timeout_s: float,
                 store_addr: tuple[str, int], doorbell: Doorbell | None = None) -> None:
        self._pg: dist.ProcessGroup | None = pg
        self._store: TCPStore | None = store  # rank 0 hosts it: keep it alive with the group
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self.bytes_sent = 0
        self.bytes_received = 0
        self._broken: str | None = None
        self.buffers: dict = {}  # receive buffers kept across syncs of one layout (receiver.py)
        self._prefix = PrefixStore(name, store)
        self._store_addr = store_addr  # (host, port): await_signal opens its own connection to it
        self._signals: PrefixStore | None = None  # a connection of its own for await_signal's long waits
        # transport.signals=socket: words come to this member's doorbell and go to the others' (signals.py)
        self._doorbell = doorbell
        self._bells: Bells | None = None
        self.signals = "socket" if doorbell is not None else "store"
        self._heartbeat = _Heartbeat(self._prefix, rank)
        self._heartbeat.start()

    def dead_peers(self) -> str:
        """Which peers look dead: their heartbeat went stale, or the store itself is gone."""
        time.sleep(_STALE_S)  # let a live peer stamp at least twice
        now, stale = time.time(), []
        try:
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                who = self._prefix.get(f"disagg_join/{r}").decode()
                last = float(self._prefix.get(f"hb/{r}").decode()) if self._prefix.check([f"hb/{r}"]) else 0.0
                if now - last > _STALE_S:
                    stale.append(f"rank {r} ({who}, silent {now - last:.1f}s)")
        except RuntimeError:
            return "the store hosted by rank 0 is unreachable: rank 0 is likely dead"
        return ("dead peer(s): " + ", ".join(stale)) if stale else "no peer looks dead (all heartbeats fresh)"

    def signal(self, key: str, value: str) -> None:
        """Say ``value`` for ``key`` to the other members (``await_signal`` there returns it): set in the
        group's store, or (``signals=socket``) rung on each other member's doorbell, where a member
        that hung up (its process ended) is logged, not raised: its own part of the sync reports it."""
        if self._doorbell is not None:
            for failed in self._peer_bells().ring({key: value}):
                log.warning("[transport:%s:%d] could not say %s=%s to a member: %s", self.name, self.rank, key,
                            value, failed)
            return
        try:
            self._prefix.set(key, value)
        except RuntimeError as e:
            raise TransportError(f"group {self.name!r} rank {self.rank}: cannot set {key!r} in the store hosted "
                                 f"by rank 0 ({_brief(e)})") from e

    def connect_bells(self) -> None:
        """(``signals=socket``) Open this member's connections to every other member's doorbell now, not
        at its first word. Rank 0 does as the group is made: its connections' end tells the others it is
        gone."""
        self._peer_bells()

    def _peer_bells(self) -> Bells:
        if self._bells is None:
            peers = [r for r in range(self.world_size) if r != self.rank]
            try:
                addresses = [parse_address(self._prefix.get(f"bell/{r}").decode()) for r in peers]
                self._bells = Bells(addresses, f"rank {self.rank}", self.timeout_s)
            except (RuntimeError, OSError) as e:
                raise TransportError(f"group {self.name!r} rank {self.rank}: cannot reach the doorbells of ranks "
                                     f"{peers} ({_brief(e)})") from e
        return self._bells

    def await_signal(self, key: str, timeout_s: float, what: str) -> str:
        """Block until another member (or the driver) says ``key`` (``signal``); its value.

        Through the store: one wait on a store connection of its own (the heartbeat's connection
        stays free, and a wait cut into timed slices would leave a connection out of step: torch's
        TCPStore), a thread logging progress every ``_PROGRESS_LOG_S``. On a doorbell
        (``signals=socket``): this thread blocks on its connections, logging the same way. Rank 0
        dying (it hosts the store; its connection to this doorbell ends) ends the wait at once.
        Raises ``TransportError`` naming ``what`` on the timeout or rank 0's loss."""
        where = f"group {self.name!r} rank {self.rank}: waiting for {what}"
        if self._doorbell is not None:
            return self._await_bell(key, timeout_s, what, where)
        t0, done = time.monotonic(), threading.Event()

        def progress() -> None:
            while not done.wait(_PROGRESS_LOG_S):
                log.info("[transport:%s:%d] still waiting for %s after %.0f s (timeout %.0f s)", self.name,
                         self.rank, what, time.monotonic() - t0, timeout_s)

        threading.Thread(target=progress, daemon=True, name=f"disagg-signal-{self.rank}").start()
        try:
            if self._signals is None:
                host, port = self._store_addr
                self._signals = PrefixStore(self.name, TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                                timeout=timedelta(seconds=self.timeout_s)))
            # get waits for the key itself, up to the store's timeout: one round trip, not a wait and a get
            self._signals.set_timeout(timedelta(seconds=timeout_s))
            return self._signals.get(key).decode()
        except RuntimeError as e:
            self._signals = None  # out of step after a failed wait
            late = time.monotonic() - t0 >= timeout_s * 0.99
            raise TransportError(f"{where}: nothing within {timeout_s:.0f} s" if late else
                                 f"{where}: the store hosted by rank 0 is unreachable ({_brief(e)}): rank 0 is "
                                 "likely dead") from e
        finally:
            done.set()

    def _await_bell(self, key: str, timeout_s: float, what: str, where: str) -> str:
        """``await_signal`` on this member's doorbell: its own thread blocks on the connections."""
        def progress(waited_s: float) -> None:
            log.info("[transport:%s:%d] still waiting for %s after %.0f s (timeout %.0f s)", self.name, self.rank,
                     what, waited_s, timeout_s)

        if self._broken == "destroyed":
            raise TransportError(f"{where}: the group was destroyed")
        try:
            return self._doorbell.wait(key, timeout_s, progress, _PROGRESS_LOG_S)
        except BellError as e:
            # the doorbell's own words: a timeout names the key and the seconds, a close says so
            raise TransportError(f"{where}: {e}: rank 0 is likely dead" if e.gone else f"{where}: {e}") from e

    def broadcast(self, tensor: torch.Tensor, src: int, *, count_bytes: bool = True) -> None:
        """Broadcast ``tensor`` in place from rank ``src``; blocks until done or raises.

        Every rank of the group must call it with the same ``src`` and size.
        ``count_bytes=False`` leaves the byte counters alone (control headers).
        """
        self.broadcast_async(tensor, src, count_bytes=count_bytes).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int, *, count_bytes: bool = True) -> "PendingOp":
        """Start a broadcast; the returned op's ``wait()`` blocks until done (with the group's timeout).

        Ops complete in the order they were started on every rank. The tensor must
        not be touched until ``wait()`` returned.
        """
        if not 0 <= src < self.world_size:
            raise ValueError(f"group {self.name!r}: src={src} outside world of {self.world_size}")
        if not tensor.is_contiguous():
            raise ValueError(f"group {self.name!r}: broadcast needs a contiguous tensor")
        nbytes = tensor.numel() * tensor.element_size()
        peers = [r for r in range(self.world_size) if r != src]
        what = f"broadcast of {nbytes} bytes " + (f"to ranks {peers}" if self.rank == src else f"from rank {src}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = src, 0, timedelta(seconds=self.timeout_s)
        work = self._start(lambda pg: pg.broadcast([tensor], opts), what)
        return PendingOp(self, work, what, nbytes if count_bytes else 0, sent=self.rank == src)

    def barrier(self) -> None:
        """Block until every rank arrives (a one-element allreduce, valid on both backends)."""
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=self.timeout_s)
        flag = torch.zeros(1, device=self.device)
        self._run(lambda pg: pg.allreduce([flag], opts), f"barrier with ranks {list(range(self.world_size))}")

    def abandon(self, reason: str) -> None:
        """Mark the group unusable and release it now: peers' pending ops on it fail instead of hanging."""
        if self._broken is None:
            self._broken = reason
        self._release_pg()

    def destroy(self) -> None:
        """Release the process group and, on rank 0, the store. Safe to call twice."""
        self._heartbeat.stop()
        self._release_pg()
        self._store, self._signals = None, None
        bells, self._bells = self._bells, None
        if bells is not None:
            bells.close()
        if self._doorbell is not None:
            self._doorbell.close()
        if self._broken is None:
            self._broken = "destroyed"

    def _run(self, start, what: str) -> None:
        self._wait(self._start(start, what), what)

    def _start(self, start, what: str) -> dist.Work:
        if self._broken is not None or self._pg is None:
            raise TransportError(f"group {self.name!r} rank {self.rank}/{self.world_size}: cannot run {what}: "
                                 f"group is unusable ({self._broken}); rebuild it")
        try:
            return start(self._pg)
        except RuntimeError as e:
            self._fail(what, _brief(e), e)

    def _wait(self, work: dist.Work, what: str) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s + (_WAIT_GRACE_S if self.backend == "gloo" else 0.0)
        next_log = t0 + _PROGRESS_LOG_S
        pause = 2e-5
        while True:
            now = time.monotonic()
            if now >= deadline:
                self._fail(what, f"did not complete within {self.timeout_s:.1f} s", None)
            if now >= next_log:
                log.warning("[transport:%s:%d] still waiting on %s after %.0f s (timeout %.0f s)",
                            self.name, self.rank, what, now - t0, self.timeout_s)
                next_log = now + _PROGRESS_LOG_S
            if self.backend == "gloo":
                # Work.wait(t) raises on its own timeout too; is_completed tells the two apart.
                try:
                    work.wait(timedelta(seconds=min(deadline, next_log) - now))
                    return
                except RuntimeError as e:
                    if work.is_completed():
                        self._fail(what, _brief(e), e)
            elif work.is_completed():
                # NCCL: wait() on a completed work only re-raises its error, never blocks.
                try:
                    work.wait()
                    return
                except RuntimeError as e:
                    self._fail(what, _brief(e), e)
            else:
                # Short naps: the wait's end is the sync's end (Linux adds ~50 us to each).
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)

    def _fail(self, what: str, reason: str, cause: BaseException | None) -> NoReturn:
        self._broken = f"{what} failed: {reason}"
        # Releasing closes this rank's connections, so peers blocked on it fail now.
        self._release_pg()
        suspects = self.dead_peers()
        raise TransportError(
            f"group {self.name!r} rank {self.rank}/{self.world_size}: {what} failed: {reason}; {suspects}"
        ) from cause

    def _release_pg(self) -> None:
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if self.backend == "nccl":
            pg.abort()  # frees the communicator at once, in flight or not; the watchdog then stays quiet
        else:
            pg.shutdown()


class PendingOp:
    """A started collective. ``wait()`` blocks with the group's timeout and counts its bytes once.

    ``wait(host=False)`` on NCCL only orders the current CUDA stream after the op
    (no host block): later kernels that reuse the buffer run after it, while the
    host keeps enqueueing. A final ``wait()`` then catches failures and timeouts.
    On gloo both block the host.
    """

    def __init__(self, group: TransportGroup, work: dist.Work, what: str, nbytes: int, sent: bool) -> None:
        self._group, self._work, self._what, self._nbytes, self._sent = group, work, what, nbytes, sent
        self._ordered = False
        self.done = False

    def wait(self, host: bool = True) -> None:
        if self.done:
            return
        if not host and self._group.backend == "nccl":
            if not self._ordered:
                self._work.wait()  # the current stream waits on the NCCL stream
                self._ordered = True
            return
        self._group._wait(self._work, self._what)
        if self._group.backend == "nccl" and not self._ordered:
            self._work.wait()
        self.done = True
        if self._sent:
            self._group.bytes_sent += self._nbytes
        else:
            self._group.bytes_received += self._nbytes


def create_group(*, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                 group_name: str, device: torch.device | None = None, high_priority: bool = False,
                 signals: str = "store") -> TransportGroup:
    """Join weight-sync group ``group_name``; rank 0 hosts its store on ``host:port``.

    Every rank calls this with the same host, port, world size, backend and name.
    Raises ``TransportError`` naming the missing ranks when the rendezvous does not
    complete within ``timeout_s``. ``device`` is the CUDA device for NCCL (default:
    the current one); gloo groups move CPU tensors. ``high_priority`` (NCCL): the group's
    collectives run on a stream of the highest CUDA priority, so their kernels take the SMs
    ahead of the packing and loading kernels queued beside them (``transport.nccl_high_priority``).
    ``signals`` (``transport.signals``): how ``signal`` / ``await_signal`` words travel, through the
    store or (``socket``) to a doorbell each member listens on (``signals.py``).
    """
    _check_group_args(backend, signals, rank, world_size, timeout_s)
    where = f"group {group_name!r} rank {rank}/{world_size} (store {host}:{port})"
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        _await_store(host, port, deadline, timeout_s, where)
    store = _open_store(host, port, rank, world_size, timeout_s, deadline, where)
    prefix = PrefixStore(group_name, store)
    try:  # the interface that reaches rank 0: this rank's doorbell and gloo device
        local = _local_address(host, port)
    except OSError as e:
        raise TransportError(f"{where}: no route from this host to rank 0's {host}: {_brief(e)}") from e
    # published before this rank's join key: every address is there once all joined
    doorbell = _open_doorbell(prefix, local, rank, where) if signals == "socket" else None
    try:
        _join(prefix, rank, world_size, deadline, timeout_s, where)
        if backend == "gloo":
            device, make = torch.device("cpu"), lambda: _gloo_group(prefix, rank, world_size, local, timeout_s)
        else:
            device = device or torch.device("cuda", torch.cuda.current_device())
            make = lambda: _nccl_group(prefix, rank, world_size, timeout_s, high_priority, where)  # noqa: E731
        try:
            pg = make()
        except RuntimeError as e:
            raise TransportError(f"{where}: could not connect the {backend} group: {_brief(e)}") from e
    except TransportError:
        if doorbell is not None:
            doorbell.close()
        raise
    group = TransportGroup(pg=pg, store=store, name=group_name, rank=rank, world_size=world_size,
                           backend=backend, device=device, timeout_s=timeout_s, store_addr=(host, port),
                           doorbell=doorbell)
    if doorbell is not None and rank == 0:
        try:
            group.connect_bells()  # rank 0's words go down these; their end tells the others it is gone
        except TransportError:
            group.destroy()
            raise
    # Every rank has built its group (NCCL: its communicator) before anyone uses it.
    group.barrier()
    log.info("[transport:%s:%d] joined %s group of %d", group_name, rank, backend, world_size)
    return group


def _check_group_args(backend: str, signals: str, rank: int, world_size: int, timeout_s: float) -> None:
    """``create_group``'s arguments, each refused by name."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"transport backend must be 'gloo' or 'nccl', got {backend!r}")
    if signals not in SIGNALS:
        raise ValueError(f"transport.signals must be one of {SIGNALS}, got {signals!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"transport timeout_s must be > 0, got {timeout_s}")


def _open_store(host: str, port: int, rank: int, world_size: int, timeout_s: float, deadline: float,
                where: str) -> TCPStore:
    """The group's store: hosted on ``host:port`` by rank 0 (retrying a port a peer's probe holds for
    a moment: ``pick_free_port``), reached there by the others."""
    bind_until = min(deadline, time.monotonic() + _BIND_RETRY_S)
    while True:
        try:
            return TCPStore(host, port, world_size, is_master=(rank == 0), wait_for_workers=False,
                            timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if rank == 0 and "EADDRINUSE" in str(e) and time.monotonic() < bind_until:
                time.sleep(0.2)
                continue
            if rank == 0:
                raise TransportError(f"{where}: could not host the store: {_brief(e)}") from e
            raise TransportError(f"{where}: could not reach the store hosted by rank 0 within {timeout_s:.1f} s "
                                 f"(missing ranks: [0]): {_brief(e)}") from e


def _open_doorbell(prefix: PrefixStore, local: str, rank: int, where: str) -> Doorbell:
    """This rank's doorbell (``transport.signals=socket``), its address published in the store."""
    doorbell = None
    try:
        doorbell = Doorbell(local)
        prefix.set(f"bell/{rank}", f"{doorbell.address[0]}:{doorbell.address[1]}")
        return doorbell
    except (OSError, RuntimeError) as e:
        if doorbell is not None:
            doorbell.close()
        raise TransportError(f"{where}: could not open this rank's doorbell: {_brief(e)}") from e


def _gloo_group(prefix: PrefixStore, rank: int, world_size: int, local: str, timeout_s: float):
    """A gloo process group over ``local``'s interface (the one that reaches rank 0)."""
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=local)]
    opts._timeout = timedelta(seconds=timeout_s)
    return ProcessGroupGloo(prefix, rank, world_size, opts)


def _nccl_group(prefix: PrefixStore, rank: int, world_size: int, timeout_s: float, high_priority: bool, where: str):
    """A NCCL process group, its watchdog later than disagg's own timeouts (a hang becomes disagg's
    error, not a watchdog kill); ``high_priority``: its stream at the highest CUDA priority."""
    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError as e:
        raise TransportError(f"{where}: backend 'nccl' needs a CUDA build of torch") from e
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s + max(timeout_s, _NCCL_WATCHDOG_MARGIN_S))
    opts.is_high_priority_stream = bool(high_priority)
    return ProcessGroupNCCL(prefix, rank, world_size, opts)


def _await_store(host: str, port: int, deadline: float, timeout_s: float, where: str) -> None:
    """Wait until rank 0's store accepts connections, within the deadline.

    TCPStore's own client retries with growing delays and overshot a 3 s timeout
    by up to 3x in tests, so reachability is probed here first.
    """
    next_log = time.monotonic() + _PROGRESS_LOG_S
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(remaining, 1.0), 1e-3)) as sock:
                if not _self_connected(sock):
                    return
            # the kernel gave this probe the store's port as its own: not rank 0's store
            error: object = "no store listening"
        except OSError as e:
            error = e
        if deadline - time.monotonic() <= 0:
            raise TransportError(f"{where}: could not reach the store hosted by rank 0 within "
                                 f"{timeout_s:.1f} s (missing ranks: [0]): {error}")
        if time.monotonic() >= next_log:
            log.warning("[transport] %s: still waiting for rank 0 to host the store", where)
            next_log = time.monotonic() + _PROGRESS_LOG_S
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


def _join(prefix: PrefixStore, rank: int, world_size: int, deadline: float, timeout_s: float, where: str) -> None:
    """Store-level rendezvous: each rank writes its key, then polls for everyone's.

    Done before building the process group so that a missing rank is reported by
    number (the store knows who wrote) rather than as a bare connect timeout. The
    missing set is refreshed while waiting because rank 0, which hosts the store,
    may give up first and take the store with it.
    """
    keys = [f"disagg_join/{r}" for r in range(world_size)]
    missing = [r for r in range(world_size) if r != rank]
    next_log = time.monotonic() + _PROGRESS_LOG_S
    try:
        prefix.set(keys[rank], f"{socket.gethostname()} pid {os.getpid()}")
        while not prefix.check(keys):
            missing = [r for r, k in enumerate(keys) if not prefix.check([k])]
            now = time.monotonic()
            if now >= deadline:
                raise TransportError(f"{where}: rendezvous did not complete within {timeout_s:.1f} s; "
                                     f"missing ranks: {missing}")
            if now >= next_log:
                log.warning("[transport] %s: still waiting for ranks %s to join", where, missing)
                next_log = now + _PROGRESS_LOG_S
            time.sleep(0.02)
    except RuntimeError as e:
        raise TransportError(f"{where}: rendezvous failed, lost the store hosted by rank 0 "
                             f"(it gave up or died: {_brief(e)}); missing ranks when last checked: {missing}") from e


def timed_ops(groups: list["TransportGroup"], op, iterations: int, device: torch.device) -> list[float]:
    """Run ``op`` ``iterations`` times, each after a barrier of each of ``groups``, timed on this rank
    to its completion on ``device``; the seconds of each. Every rank of the groups calls it."""
    out = []
    for _ in range(iterations):
        for g in groups:
            g.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def timed_raw_broadcasts(group: "TransportGroup", nbytes: int, repeats: int, device: torch.device) -> list[float]:
    """``repeats`` broadcasts of one flat ``nbytes`` buffer from rank 0 over ``group`` (``timed_ops``):
    the raw rate a sync over the same group is measured against. Every rank calls it."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return timed_ops([group], lambda: group.broadcast(buf, 0, count_bytes=False), repeats, device)
