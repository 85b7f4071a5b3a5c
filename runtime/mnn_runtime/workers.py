"""Worker processes that share one copy of the weights.

The parent loads and warms every version (one MNN thread: fork-safe), binds the listening
socket, then forks the workers: the weights are shared copy-on-write. The parent accepts the
connections and deals them out to the workers; each worker serves its connections with its own
event loop. Only the parent follows the config: it sends every change to the workers (weights
change in every worker at once), and when a version is added or its file changes, it loads the
file (once, on a thread) and replaces the workers one by one, so new weights are shared as well.
The parent supervises: a worker that dies is replaced (the others keep serving), SIGTERM is
passed on and every worker drains its in-flight requests before exiting.

Here: the supervisor's loop, dealing connections and following the config. Elsewhere: the
worker processes (``workers_pool``: forking, replacing; ``workers_process``: a worker after the
fork), the messages between them (``workers_channel``), the pod-wide metrics
(``workers_metrics``) and how many workers ``auto`` means (``workers_cpus``).
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import queue
import select
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mnn_rollout.contract.routing import WORKERS_DIFFER

from . import engine
from .workers_channel import (AGAIN_MESSAGE, ALIVE_MESSAGE, CONNECTION, GRPC_CONNECTION, RELOAD_MESSAGE,
                              PodRouting, send_config, send_connection, send_message)
from .workers_pool import WorkerPool

log = logging.getLogger(__name__)

# accept() failing for want of resources (descriptors, kernel memory) fails again at once: the
# listener is left alone this long instead of being retried in a tight loop (asyncio's own delay)
ACCEPT_RETRY_SECONDS = 1.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# A serving worker says it is alive every second from its event loop; one silent this long has its
# loop stuck (a forward that never returns): it is killed and replaced. Its connections waited for
# ever, and its probes, dealt in turn with the others', failed too seldom for the kubelet to act.
HANG_SECONDS = 30.0
# ... unless it is inside a model load (MNN holds the GIL throughout: its loop says nothing), for at
# most this long: one stuck there (a read that never returns) holds the pod's load lock, which every
# other load waits for, the supervisor's too (and no worker is started while the supervisor loads).
LOAD_SECONDS = 600.0


class Supervisor(WorkerPool):
    """Fork ``workers`` children running ``serve_one(channel, ready_fd)``; replace any that dies.

    This process accepts every connection on ``sock`` (and on ``grpc_sock``, with ``serve
    --grpc-port``) and hands it to a worker over that worker's ``channel`` (a Unix socket; the file
    descriptor travels as SCM_RIGHTS), round robin over the workers that serve and are not being
    retired, each kind of connection in its own turn. (gRPC's connections were once taken by the
    workers themselves, each binding the port with SO_REUSEPORT: the kernel's hash of each
    connection's addresses then gave one worker 20 of a load generator's 32 and the other 12.)
    Workers sharing one listening socket instead let whichever woke first take a whole burst of
    connections (measured: all 32 of a load generator's on one worker in one round of three), and a
    worker being retired could not give back the connections waiting in its queue. Each child
    writes one byte to ``ready_fd`` once it serves. ``offer(config)`` (from any thread) hands the
    supervisor a new config: it applies it in this process with ``apply``, and when that loaded a
    new or changed version, replaces the workers one at a time (a new one is forked with the new weights, and once it serves, the old
    one is retired: SIGUSR2, it stops accepting, finishes what it holds and exits), so the new
    weights are shared too and no request is dropped.

    Each worker says what it routes by (its table's digest and weights, and what it shadows) every
    second and after each config it applied; the supervisor writes into ``routing`` (shared with the
    workers, read by their ``/status``) the table every live worker routes by, or that they differ and
    which lag behind ``target`` (the digest of the newest config sent; at first, the one they are
    forked with) or ``target_shadow`` (its shadow: ``shadow.setting``, which the digest leaves out).
    """

    def __init__(self, workers: int, sock: socket.socket, serve_one: Callable[[socket.socket, int], None],
                 metrics_dir: Path | None, apply: Callable[[Any], bool] | None = None,
                 ready_timeout: float = 60.0, reload: Callable[[list[str]], bool] | None = None,
                 grpc_sock: socket.socket | None = None, hang_timeout: float = HANG_SECONDS,
                 load_timeout: float = LOAD_SECONDS,
                 target: str = "", target_shadow: dict[str, Any] | None = None) -> None:
        super().__init__(workers, sock, serve_one, metrics_dir, grpc_sock)
        self.routing = PodRouting()  # made before any fork: every worker shares it
        self._target = target  # the table digest of the newest config sent to the workers
        self._routes: dict[int, tuple[str, dict[str, int]]] = {}  # worker -> (table digest, weights) it said
        self._serves: dict[int, list[str]] = {}  # worker -> the versions it said it can serve now
        self._target_shadow = target_shadow  # what the newest config sent shadows (None: nothing)
        self._shadows: dict[int, dict[str, Any] | None] = {}  # worker -> what it said it shadows
        self._routing_changed = True
        self.hang_timeout, self.load_timeout = hang_timeout, load_timeout
        self._heard: dict[int, float] = {}  # serving worker -> when it last wrote (ALIVE_MESSAGE, ...)
        # worker not serving yet -> when it was started, when its ready clock started, and the seconds
        # of its own model loads seen since (_overdue)
        self._forked: dict[int, tuple[float, float, float]] = {}
        self._checked: float | None = None  # when _kill_hung last ran
        self._awaited: int | None = None  # the replacement a roll waits for (killed by the roll if need be)
        self.apply = apply
        self.reload = reload  # load again versions a worker loaded for a request; True: replace the workers
        self._reloads: set[str] = set()
        self.ready_timeout = ready_timeout
        self._turns = {CONNECTION: 0, GRPC_CONNECTION: 0}  # the next worker in turn, per kind
        for listener in self.listeners:
            listener.setblocking(False)
        self._pending: queue.SimpleQueue[tuple[Any, bytes, str, dict[str, Any] | None]] = queue.SimpleQueue()
        self._deferred: tuple[Any, bytes] | None = None  # sent to the workers, not applied here yet
        self._config_text = b""  # the newest config sent to the workers
        self._missed: set[int] = set()  # workers whose full channel refused it: sent again, no connection meanwhile
        self._loader: threading.Thread | None = None  # applying a config (loading) off the main loop
        self._loaded: list[bool] = []  # the loader's answer: must the workers be replaced?
        self._main_calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._accept_paused: dict[socket.socket, float] = {}  # listener -> when to try accept() again

    def offer(self, config: Any, text: bytes = b"", digest: str = "", shadow: dict[str, Any] | None = None) -> None:
        """Hand a new config to the supervisor loop (thread-safe, returns at once); ``text`` is
        sent to every worker before the supervisor applies the config itself; ``digest``: the
        digest of the table it routes by, ``shadow``: what it shadows (workers that do not say
        both lag)."""
        self._pending.put((config, text, digest, shadow))
        self._wake()

    def call_in_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the supervisor's own thread (thread-safe): what another thread must not
        do itself, such as writing metrics a fork could catch half-done."""
        self._main_calls.put(fn)
        self._wake()

    def _may_fork(self) -> bool:
        return self._loader is None  # never fork while the loader is inside MNN

    def _started(self, pid: int, channel: socket.socket) -> None:
        now = time.monotonic()
        self._forked[pid] = (now, now, 0.0)
        self._routing_changed = True  # it lags until it says (and counts once it serves: _publish)
        if self._deferred is not None and self._deferred[1]:  # newer than what it was forked with
            if not send_config(pid, channel, self._deferred[1]):  # (the newest sent: _forward_pending)
                self._missed.add(pid)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGCHLD, lambda *_: self._wake())
        # Keep the garbage collector off the parent's objects in the workers: a collection
        # writes to every object it visits, which would copy the shared pages into each worker.
        gc.freeze()
        for slot in range(self.workers):
            self._spawn(slot)
        while self.children or (self._respawn and not self.stopping):
            self._wait(0.1 if self._respawn else 0.5)
            self._reap()
            if not self.stopping:
                self._apply_pending()
        if self._loader is not None:
            self._loader.join(timeout=30)
        for listener in self.listeners:
            listener.close()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return 0

    def _wait(self, timeout: float) -> None:
        """Hand over new connections until woken (a signal, a config) or a child reports ready,
        at most ``timeout``."""
        if self.stopping and self.listeners:  # refused from now on, not left in a backlog no one reads
            for listener in self.listeners:
                listener.close()
            self.listeners = {}
        now = time.monotonic()
        for listener, until in list(self._accept_paused.items()):
            if until <= now:
                del self._accept_paused[listener]
        if self._accept_paused:
            timeout = min(timeout, min(self._accept_paused.values()) - now)
        self._kill_hung(now)
        listening = {s.fileno(): s for s in self.listeners if s not in self._accept_paused}
        channels = {ch.fileno(): ch for pid, ch in self._channels.items() if pid not in self.retiring}
        by_channel = {ch.fileno(): pid for pid, ch in self._channels.items()}
        fds = [self._wake_r, *self._ready_fds.values(), *listening, *channels]
        try:
            readable, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        by_fd = {fd: pid for pid, fd in self._ready_fds.items()}
        for fd in readable:
            if fd == self._wake_r:
                os.read(fd, 4096)
                while not self._main_calls.empty():
                    try:
                        self._main_calls.get()()
                    except Exception:  # noqa: BLE001 - one bad call must not stop the supervisor
                        log.exception("supervisor call failed")
                continue
            if fd in listening:
                self._accept(listening[fd])
                continue
            if fd in channels:
                self._from_worker(by_channel[fd], channels[fd])
                continue
            pid = by_fd[fd]
            said = os.read(fd, 1)  # a byte: the child serves; b"" (EOF): it died first
            os.close(fd)
            del self._ready_fds[pid]
            if said and pid in self.children:
                self.ready.add(pid)
                self._routing_changed = True  # it counts from now on: the workers differ until it says
                self._heard[pid] = time.monotonic()
                log.info("worker pid %d serves", pid)
        self._publish()

    def _from_worker(self, pid: int, channel: socket.socket) -> None:
        """What a worker wrote back: that it is alive and what it routes by, the versions it loaded
        again for a request (the next ``_apply_pending`` loads them here too), a config it lost."""
        while True:
            try:
                data = channel.recv(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not data:
                return
            self._heard[pid] = time.monotonic()
            if data.startswith(ALIVE_MESSAGE) and len(data) > len(ALIVE_MESSAGE):
                self._said(pid, data[len(ALIVE_MESSAGE):])
            elif data.startswith(RELOAD_MESSAGE):
                self._reloads.add(data[len(RELOAD_MESSAGE):].decode(errors="replace"))
                self._wake()
            elif data == AGAIN_MESSAGE and self._config_text:  # sent again by the next _forward_pending
                self._missed.add(pid)

    def _said(self, pid: int, routing: bytes) -> None:
        """Worker ``pid`` routes by this (``workers_channel.routing_of``)."""
        try:
            said = json.loads(routing)
            route, serves = (said["table_digest"], said["weights"]), said.get("serves", [])
            shadow = said.get("shadow")
            if not (isinstance(route[0], str) and isinstance(route[1], dict) and isinstance(serves, list)
                    and all(isinstance(name, str) for name in serves)):
                raise TypeError("not a digest, weights and version names")
            if shadow is not None and not (isinstance(shadow, dict) and isinstance(shadow.get("version"), str)
                                           and isinstance(shadow.get("percent"), int)):
                raise TypeError("not a shadow's version and percent")
        except (ValueError, TypeError, KeyError, AttributeError):
            log.warning("worker pid %d said it routes by %r: not understood", pid, routing[:200])
            return
        if self._routes.get(pid) != route or self._serves.get(pid) != serves or self._shadows.get(pid) != shadow:
            self._routes[pid], self._serves[pid], self._shadows[pid] = route, serves, shadow
            self._routing_changed = True

    def _publish(self) -> None:
        """Write into ``routing`` what every serving worker routes by, or that they differ (one has
        not said yet, or said another table) with a lagging one's weights, and which live workers
        lag behind the newest config: what their ``/status`` reports for the whole pod; and which
        versions each serving worker can serve. One still starting counts once it serves or says (it
        says first: ``server._Server.startup``)."""
        if not self._routing_changed:
            return
        self._routing_changed = False
        live = sorted(pid for pid in self.children if pid not in self.retiring)
        said = {pid: self._routes[pid] for pid in live if pid in self._routes}
        lagging = [pid for pid in live if pid not in said or (self._target and (
            said[pid][0] != self._target or self._shadows.get(pid) != self._target_shadow))]
        # One starting (not serving yet, nothing said) routes no request: a roll's new worker, loading
        # its own copy of a version, must not make the pod look as if it served another table meanwhile.
        serving = [pid for pid in live if pid in self.ready or pid in said]
        # what each serving worker can serve (one that has not said yet: nothing), for /status's versions
        serves = {str(pid): self._serves.get(pid, []) for pid in serving}
        if serving and len(said) == len(serving) and len({digest for digest, _ in said.values()}) == 1:
            digest, weights = said[serving[0]]
            state = {"table_digest": digest, "weights": weights, "lagging": lagging, "serves": serves}
            shadows = [self._shadows.get(pid) for pid in serving]
            if any(shadow != shadows[0] for shadow in shadows):  # one lags on a shadow change (no table change)
                state["shadow"] = WORKERS_DIFFER
            elif shadows[0] is not None:
                state["shadow"] = shadows[0]
            self.routing.write(state)
            return
        behind = next((said[pid] for pid in lagging if pid in said), None) or next(iter(said.values()), None)
        self.routing.write({"table_digest": None, "weights": behind[1] if behind else None, "lagging": lagging,
                            "serves": serves})

    def _reap(self) -> None:
        children = set(self.children)
        super()._reap()
        if children != set(self.children):
            for pid in [p for p in self._routes if p not in self.children]:
                del self._routes[pid]
                self._serves.pop(pid, None)
                self._shadows.pop(pid, None)
            self._routing_changed = True
        self._publish()

    def _kill_hung(self, now: float) -> None:
        """Kill every serving worker silent for ``hang_timeout`` (what it wrote meanwhile, read
        first: this loop may have been the slow one), and every worker not serving ``ready_timeout``
        after it was started (at start or after a death: one stuck before it serves would else stay
        for ever, a slot short, and the pod's status saying its workers differ; ``_overdue``); each is
        replaced as one that died. A roll's replacement is the roll's to kill (``_roll``). Neither
        clock runs while a model load is under way: MNN's load holds the GIL throughout (a worker's
        loop says nothing for as long as it takes: a big model's can take more than
        ``hang_timeout``), and a worker about to serve may be waiting for the pod's one load at a
        time (``engine``); for at most ``load_timeout`` (one load; a starting worker's, all of them
        but its own)."""
        loading = self._in_load(now)
        elapsed, self._checked = now - (now if self._checked is None else self._checked), now
        for pid, (started, _, own) in list(self._forked.items()):
            if pid not in self.children or pid in self.ready or pid in self.retiring:
                del self._forked[pid]
                continue
            if loading is not None:  # its own load (versions a worker loads after the fork), or one it may wait for
                self._forked[pid] = (started, now, own + elapsed if loading == pid else own)
            why = self._overdue(pid, now)
            if why is not None and pid != self._awaited:
                fd = self._ready_fds.get(pid)
                if fd is not None and select.select([fd], [], [], 0)[0]:
                    continue  # it said it serves (or died): read by this loop next
                self._kill_stuck(pid, why)
        for pid in [p for p in self._heard if p not in self.children or p in self.retiring]:
            del self._heard[pid]
        for pid, heard in list(self._heard.items()):
            if pid == loading:  # alive, inside a load
                self._heard[pid] = now
                continue
            if now - heard < self.hang_timeout or pid not in self.ready:
                continue
            self._from_worker(pid, self._channels[pid])
            if self._heard[pid] != heard:
                continue
            self._kill_stuck(pid, f"has not answered for {now - heard:.0f} s (its loop is stuck)")

    def _overdue(self, pid: int, now: float, started: float | None = None) -> str | None:
        """Why worker ``pid``, started (at ``started``, else when ``_started`` saw it) and not
        serving yet, is given up now, or None while it has time: ``ready_timeout`` counted from the
        end of the last model load seen in the pod (``_kill_hung`` moves its clock on during one: it
        may have had to wait for it), but ``ready_timeout + load_timeout`` from its start whatever
        loads run (else loads back to back kept it waiting for ever), the time of its own loads not
        counted (a worker loading many versions after its fork is getting on: each of its loads is
        bounded by ``load_timeout``, ``_in_load``). For every worker starting, a roll's (``_roll``)
        as one started at the pod's start or after a death."""
        forked, since, own = self._forked.get(pid, (now, now, 0.0))
        started = forked if started is None else started
        cap = self.ready_timeout + self.load_timeout
        if now - started - own >= cap:
            of_its_own = f", {own:.0f} s of its own loads not counted" if own >= 0.5 else ""
            return (f"does not serve {now - started:.0f} s after it was started, model loads in the pod included "
                    f"(at most ready_timeout + load_timeout, {cap:g} s{of_its_own})")
        if now - max(since, started) >= self.ready_timeout:
            return f"does not serve {now - started:.0f} s after it was started (stuck before it serves)"
        return None

    def _kill_stuck(self, pid: int, why: str) -> None:
        """Kill worker ``pid``, judged stuck (``why``, logged), and count it as serving no longer (no
        connection for it until it is reaped): it is replaced as one that died."""
        log.error("worker pid %d %s: killed, and replaced", pid, why)
        self.ready.discard(pid)
        self._heard.pop(pid, None)
        self._forked.pop(pid, None)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _in_load(self, now: float) -> int | None:
        """The process inside a model load (``engine.load_holder``), asked only when it matters
        (a worker starting, or one silent for half of ``hang_timeout``: one seen in a load counts as
        heard then, so one whose load ends has the other half to speak before it is judged); a
        worker inside one load for ``load_timeout`` is killed (stuck there, it holds every load)."""
        if not self._forked and all(now - heard < self.hang_timeout / 2 for heard in self._heard.values()):
            return None
        held = engine.load_holder()
        if held is None:
            return None
        loading, began = held  # began: None in the moment the load is taken or let go
        if began is None or now - began < self.load_timeout:
            return loading
        if loading in self.children:
            self._kill_stuck(loading, f"has been inside one model load for {now - began:.0f} s (stuck)")
        return None  # (this process's own: the workers waiting for it are judged as any other)

    def broadcast(self, message: bytes) -> None:
        """Send a message to every worker that is not being retired (on the supervisor's thread)."""
        for pid, channel in list(self._channels.items()):
            if pid not in self.retiring:
                send_message(pid, channel, message)

    def _accept(self, listener: socket.socket) -> None:
        kind = self.listeners[listener]
        for _ in range(256):  # a burst, then back to the loop (signals, children, configs)
            if self.stopping or not any(pid not in self.retiring for pid in self.children):
                return  # leave them in the backlog: a worker is on its way (or we are stopping)
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:  # the connections wait in the backlog meanwhile
                    log.warning("accept failed: %s; trying again in %g s", exc, ACCEPT_RETRY_SECONDS)
                    self._accept_paused[listener] = time.monotonic() + ACCEPT_RETRY_SECONDS
                else:  # one connection's trouble (reset while queued): the next one
                    log.warning("accept failed: %s", exc)
                return
            with conn:
                if conn.family in (socket.AF_INET, socket.AF_INET6):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._hand_over(conn, kind)

    def _hand_over(self, conn: socket.socket, kind: bytes) -> None:
        """Send ``conn`` to the next worker in ``kind``'s turn (serving ones first); the caller
        closes our copy."""
        live = [pid for pid in self.children if pid not in self.retiring]
        order = [pid for pid in live if pid in self.ready] or live
        for i in range(len(order)):
            pid = order[(self._turns[kind] + i) % len(order)]
            if pid in self._missed and not self._send_missed(pid):
                continue  # it would route this connection by an older config
            try:
                send_connection(self._channels[pid], conn, kind)
            except OSError:  # it died, or its channel is full (it stopped reading): the next one
                continue
            self._turns[kind] = (self._turns[kind] + i + 1) % max(1, len(order))
            return
        log.error("no worker could take a connection (all busy or gone); it is closed")

    def _broadcast(self, text: bytes, digest: str = "", shadow: dict[str, Any] | None = None) -> None:
        """Send a config to every worker (they apply new weights at once; a version they do not
        have yet stays pending until they are replaced). One whose channel is full (its loop busy,
        connections piled up) gets it again as soon as it takes it (``_send_missed``)."""
        self._config_text = text
        self._missed = {pid for pid, channel in list(self._channels.items())
                        if pid not in self.retiring and not send_config(pid, channel, text)}
        if digest:  # the workers that do not route (and shadow) by it yet lag
            self._target, self._target_shadow, self._routing_changed = digest, shadow, True

    def _send_missed(self, pid: int) -> bool:
        """Send the newest config again to a worker that missed it; True once it took it."""
        channel = self._channels.get(pid)
        if channel is None or not send_config(pid, channel, self._config_text, quiet=True):
            return False
        self._missed.discard(pid)
        log.info("worker pid %d took the config it had missed", pid)
        return True

    def _forward_pending(self) -> None:
        """Send the newest config handed in to every worker now; this process applies it later
        (it may have to load a version first)."""
        newest = None
        while not self._pending.empty():
            newest = self._pending.get()  # only the newest matters
        if newest is not None:
            self._deferred = (newest[0], newest[1])
            if newest[1]:
                self._broadcast(newest[1], newest[2], newest[3])
        self._missed &= self.children.keys()  # those gone are replaced from the newest state
        for pid in list(self._missed):
            self._send_missed(pid)
        self._publish()

    def _apply_pending(self) -> None:
        """Apply the newest config in this process on a loader thread (loading a version can take
        seconds: connections keep being handed out meanwhile); once done, replace the workers if
        it loaded something."""
        self._forward_pending()
        if self._loader is not None:
            if self._loader.is_alive():
                return
            self._loader = None
            if self._loaded.pop():
                self._roll()
            self._reap()  # respawns that waited for the load
        if self._reloads and self.reload is not None and self._deferred is None:
            names, self._reloads = sorted(self._reloads), set()
            reload = self.reload
            self._start_loader(lambda: reload(names))
            return
        if self._deferred is None or self.apply is None:
            return
        config, _ = self._deferred
        self._deferred = None
        apply = self.apply
        self._start_loader(lambda: apply(config))

    def _start_loader(self, work: Callable[[], bool]) -> None:
        """Run ``work`` (load something) on the loader thread; once it returns True, the workers
        are replaced (``_apply_pending``)."""

        def load() -> None:
            try:
                changed = work()
            except Exception:  # noqa: BLE001 - a bad update must never take the supervisor down
                log.exception("the supervisor could not apply a new config; workers keep theirs")
                changed = False
            self._loaded.append(changed)
            self._wake()

        self._loader = threading.Thread(target=load, name="config-load", daemon=True)
        self._loader.start()

    def _roll(self) -> None:
        """Replace every worker by one forked now (sharing what was just loaded), one at a time.
        A replacement has the time any worker starting has (``_overdue``), counted from this
        roll's start of it (one that died before serving is followed by its own replacement); else
        the old one is kept."""
        gc.freeze()
        for old, slot in sorted(self.children.items(), key=lambda item: item[1]):
            if self.stopping or old in self.retiring or old not in self.children:
                continue
            started = time.monotonic()
            new = self._spawn(slot)
            why = None
            while new not in self.ready and not self.stopping:
                why = self._overdue(new, time.monotonic(), started)
                if why is not None:
                    break
                self._awaited = new
                self._wait(0.2)
                self._reap()
                self._forward_pending()  # new weights reach the workers during a roll too
                if new not in self.children:  # it died before serving (and was replaced): follow that one
                    new = next((p for p, s in self.children.items() if s == slot and p != old), new)
            self._awaited = None
            if self.stopping:  # SIGTERM: the replacement stops with the rest (_stop)
                log.info("worker %d: the roll stops with its replacement (pid %d) started: shutting down", slot, new)
                break
            if new not in self.ready:
                log.error("worker %d: its replacement (pid %d) %s; keeping pid %d", slot, new, why, old)
                if new in self.children:
                    self.retiring.add(new)  # not respawned when reaped
                    self._routing_changed = True
                    os.kill(new, signal.SIGKILL)
                continue
            if old not in self.children:  # it died meanwhile: its replacement serves already
                continue
            self.retiring.add(old)
            self._routing_changed = True
            try:
                os.kill(old, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        if not self.stopping:
            log.info("workers replaced with the new versions loaded")
