"""
The Service proxy of the kubelet stand-in (see ``kubelet.py``): kube-proxy's part, for TCP.

Every Service with a selector gets an address of its own (a loopback IP, standing in for its
ClusterIP, which the emulator does not allocate) listening on each of its ports. Each new
connection goes to one of the port's endpoints, chosen at random as kube-proxy's iptables mode
does, and stays with that pod until either side closes it, also after the pod has left the
endpoints (conntrack). With no endpoint a connection is refused (reset), as kube-proxy rejects it.

Endpoints follow the pods as the EndpointSlice controller has them: a pod of the selector counts
once its Ready condition is True, and no longer once it is not or once it is being deleted (a
deletionTimestamp). A change takes effect ``delay`` seconds after the stand-in sees it in the API
(kube-proxy lags the API by a few hundred milliseconds); the stand-in sees the API once per tick.
A named ``targetPort`` is looked up in each pod's container ports.

Not simulated: UDP/SCTP, sessionAffinity, NodePort/LoadBalancer/ExternalName, externalIPs,
topology, traffic policies, serving-but-terminating endpoints, headless Services (no address).
"""
import asyncio
import functools
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from .kubelet_pods import IPAllocator

Key = tuple[str, str]  # (namespace, name)
Endpoint = tuple[str, int]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _ready(pod: dict[str, Any]) -> bool:
    if pod['metadata'].get('deletionTimestamp'):
        return False
    status = pod.get('status') or {}
    if not status.get('podIP'):
        return False
    return any(c.get('type') == 'Ready' and c.get('status') == 'True' for c in status.get('conditions') or [])


def _target(port: dict[str, Any], pod: dict[str, Any]) -> int | None:
    target = port.get('targetPort', port['port'])
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for c in (pod.get('spec') or {}).get('containers') or []:
        for p in c.get('ports') or []:
            if p.get('name') == target and (p.get('protocol') or 'TCP') == (port.get('protocol') or 'TCP'):
                return int(p['containerPort'])
    return None


def endpoints(service: dict[str, Any], pods: Iterable[dict[str, Any]]) -> dict[int, tuple[Endpoint, ...]]:
    """The ready endpoints of each TCP port of ``service`` (by the Service's port number)."""
    spec = service.get('spec') or {}
    selector = spec.get('selector') or {}
    ns = service['metadata']['namespace']
    ready = [p for p in pods if p['metadata'].get('namespace') == ns and selector
             and _matches(selector, p['metadata'].get('labels') or {}) and _ready(p)]
    out: dict[int, tuple[Endpoint, ...]] = {}
    for port in spec.get('ports') or []:
        if (port.get('protocol') or 'TCP') != 'TCP':
            continue
        found = ((p['status']['podIP'], _target(port, p)) for p in ready)
        out[int(port['port'])] = tuple(sorted((ip, t) for ip, t in found if t is not None))
    return out


class _Listener:
    def __init__(self, server: asyncio.AbstractServer, address: str) -> None:
        self.server, self.address = server, address
        self.endpoints: tuple[Endpoint, ...] = ()


class ServiceProxy:
    """Listens for every Service it is told about (``sync``, from the stand-in's loop) on an
    asyncio loop of its own, in a daemon thread."""

    def __init__(self, ips: IPAllocator, delay: float = 0.3, event: Callable[[str], None] = lambda _: None,
                 rng: random.Random | None = None) -> None:
        self.ips, self.delay, self.event = ips, delay, event
        self.rng = rng or random.Random()
        self.addresses: dict[Key, str] = {}  # the Service's address (set at first sight)
        self.connections: Counter[Endpoint] = Counter()  # connections forwarded, per endpoint
        self.open: Counter[Endpoint] = Counter()  # connections open now, per endpoint
        self.refused = 0  # connections reset for want of an endpoint
        self._seen: dict[Key, tuple[str, dict[int, tuple[Endpoint, ...]]]] = {}  # uid, endpoints by port
        self._listeners: dict[tuple[Key, int], _Listener] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name='service-proxy', daemon=True)
        self._thread.start()

    # --- from the stand-in's thread ---------------------------------------------------------------

    def sync(self, services: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]) -> None:
        """What the API shows now; each change is applied ``delay`` s later, in the order seen."""
        pods = list(pods)
        current: dict[Key, tuple[str, dict[int, tuple[Endpoint, ...]]]] = {}
        for svc in services:
            spec = svc.get('spec') or {}
            if not spec.get('selector') or spec.get('clusterIP') == 'None' or \
                    spec.get('type', 'ClusterIP') == 'ExternalName':
                continue
            key = (svc['metadata']['namespace'], svc['metadata']['name'])
            current[key] = (svc['metadata'].get('uid', ''), endpoints(svc, pods))
        changes = {k: v for k, v in current.items() if self._seen.get(k) != v}
        gone = [k for k in self._seen if k not in current]
        if not changes and not gone:
            return
        for key, (uid, by_port) in changes.items():
            if key not in self.addresses or self._seen.get(key, (uid,))[0] != uid:
                self.addresses[key] = self.ips.allocate(list(by_port))
        self._seen = current
        seen_at = time.monotonic()
        snapshot: list[tuple[Key, str | None, dict[int, tuple[Endpoint, ...]]]] = [
            *((k, self.addresses[k], v[1]) for k, v in changes.items()), *((k, None, {}) for k in gone)]
        for key in gone:
            self.addresses.pop(key, None)
        delay = max(0.0, self.delay - (time.monotonic() - seen_at))
        self._loop.call_soon_threadsafe(lambda: self._loop.call_later(delay, self._apply, snapshot))

    def listening(self, namespace: str, name: str) -> dict[int, tuple[Endpoint, ...]]:
        """The ports the Service listens on now, each with the endpoints new connections go to."""
        with self._lock:
            return {p: lst.endpoints for (key, p), lst in self._listeners.items() if key == (namespace, name)}

    def stop(self) -> None:
        async def close() -> None:
            for lst in self._listeners.values():
                lst.server.close()
            self._listeners.clear()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    # --- on the proxy's loop -------------------------------------------------------------------------

    def _apply(self, snapshot: list[tuple[Key, str | None, dict[int, tuple[Endpoint, ...]]]]) -> None:
        self._loop.create_task(self._apply_async(snapshot))

    async def _apply_async(self, snapshot: list[tuple[Key, str | None, dict[int, tuple[Endpoint, ...]]]]) -> None:
        for key, address, by_port in snapshot:
            for (k, port) in [lk for lk in self._listeners if lk[0] == key]:
                if address is None or port not in by_port or self._listeners[(k, port)].address != address:
                    with self._lock:
                        closed = self._listeners.pop((k, port))
                    closed.server.close()
            if address is None:
                self.event(f'service {key[0]}/{key[1]}: gone')
                continue
            for port, eps in by_port.items():
                lst = self._listeners.get((key, port))
                if lst is None:
                    try:
                        server = await asyncio.start_server(
                            functools.partial(self._forward, key=key, port=port), address, port)
                    except OSError as e:
                        self.event(f'service {key[0]}/{key[1]}: cannot listen on {address}:{port}: {e}')
                        continue
                    lst = _Listener(server, address)
                    with self._lock:
                        self._listeners[(key, port)] = lst
                lst.endpoints = eps
                self.event(f'service {key[0]}/{key[1]} {address}:{port} -> {", ".join(f"{i}:{p}" for i, p in eps)}')

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: Key, port: int) -> None:
        lst = self._listeners.get((key, port))
        eps = lst.endpoints if lst is not None else ()
        if not eps:
            self.refused += 1
            _reset(writer)
            return
        ip, target = self.rng.choice(eps)
        try:
            up_reader, up_writer = await asyncio.open_connection(ip, target)
        except OSError:
            self.refused += 1
            _reset(writer)
            return
        self.connections[(ip, target)] += 1
        self.open[(ip, target)] += 1
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self.open[(ip, target)] -= 1
            for w in (writer, up_writer):
                w.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info('socket')
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
    writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until its end (then half-close the other side) or a failure (then close)."""
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
