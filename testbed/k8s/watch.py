"""
Watch streams: newline-delimited JSON events with ``Content-Type: application/json`` (what kubectl
and client-go accept). Honours ``resourceVersion`` (replay from the bounded history, a 410 Gone ERROR
event when it is too old), ``timeoutSeconds``, ``allowWatchBookmarks`` (periodic BOOKMARKs),
``sendInitialEvents`` (synthetic ADDED + the ``k8s.io/initial-events-end`` bookmark), selectors with
ADDED/DELETED transitions when an object starts/stops matching, and Table output for ``kubectl get -w``.
"""
import asyncio
import json
from typing import Any, Callable

import aiohttp.web

from . import tables
from .errors import ApiError
from .resources import ResourceDef
from .store import Event, Store

DEFAULT_TIMEOUT = 1800.0  # a real server picks 30-60 minutes
TICK = 0.5  # how often a quiet stream checks for a gone client, timeouts and bookmarks


async def serve_watch(raw: aiohttp.web.BaseRequest, store: Store, rd: ResourceDef, namespace: str | None,
                      match: Callable[[dict[str, Any]], bool], params: dict[str, str],
                      as_table: bool, bookmark_interval: float) -> aiohttp.web.StreamResponse:
    rv_param = params.get('resourceVersion', '')
    bookmarks = params.get('allowWatchBookmarks') in ('true', '1')
    send_initial = params.get('sendInitialEvents') in ('true', '1')
    if send_initial and (not bookmarks or params.get('resourceVersionMatch') != 'NotOlderThan'):
        raise ApiError(422, 'Invalid', 'sendInitialEvents requires allowWatchBookmarks=true and'
                                       ' resourceVersionMatch=NotOlderThan')
    try:
        timeout = float(params.get('timeoutSeconds') or DEFAULT_TIMEOUT)
    except ValueError:
        raise ApiError.bad_request(f'invalid timeoutSeconds: {params.get("timeoutSeconds")!r}')

    def relevant(event: Event) -> bool:
        return event.group == rd.group and event.plural == rd.plural and (
            not namespace or event.object['metadata'].get('namespace') == namespace)

    # --- the synchronous part: a consistent snapshot + subscription (no events can slip between) ---
    queue: asyncio.Queue[Event] = asyncio.Queue()
    initial: list[tuple[str, dict[str, Any]]] = []
    gone: ApiError | None = None
    if rv_param in ('', '0') or send_initial:
        initial = [('ADDED', obj) for obj in store.list(rd, namespace, match)]
    else:
        try:
            since = int(rv_param)
        except ValueError:
            raise ApiError.bad_request(f'invalid resource version: {rv_param!r}')
        if since < store.compacted_rv:
            gone = ApiError.gone(f'too old resource version: {since} ({store.compacted_rv + 1})')
        else:
            for event in store.history:
                if event.rv > since and relevant(event):
                    typed = _transition(event, match)
                    if typed:
                        initial.append((typed[0], store.render(rd, typed[1])))
    start_rv = store.rv
    epoch = store.watch_epoch
    listeners = store.listeners.setdefault((rd.group, rd.plural), set())
    listeners.add(queue.put_nowait)

    response = aiohttp.web.StreamResponse(status=200, headers={
        'Content-Type': 'application/json', 'Cache-Control': 'no-cache, private'})
    response.enable_chunked_encoding()
    headers_sent = False

    async def send(etype: str, obj: dict[str, Any]) -> None:
        nonlocal headers_sent
        if as_table and etype in ('ADDED', 'MODIFIED', 'DELETED'):
            obj = tables.table(rd, [obj], obj['metadata'].get('resourceVersion', ''),
                               params.get('includeObject', 'Metadata'), headers=not headers_sent)
            headers_sent = True
        await response.write(json.dumps({'type': etype, 'object': obj}).encode() + b'\n')

    def bookmark(rv: int, initial_end: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {'resourceVersion': str(rv)}
        if initial_end:
            meta['annotations'] = {'k8s.io/initial-events-end': 'true'}
        return {'kind': rd.kind, 'apiVersion': rd.api_version, 'metadata': meta}

    loop = asyncio.get_running_loop()
    try:
        await response.prepare(raw)
        if gone is not None:
            await response.write(json.dumps({'type': 'ERROR', 'object': gone.status()}).encode() + b'\n')
            await response.write_eof()
            return response
        for etype, obj in initial:
            await send(etype, obj)
        if send_initial:
            await send('BOOKMARK', bookmark(start_rv, initial_end=True))
        deadline = loop.time() + timeout
        last_bookmark = loop.time()
        while (remaining := deadline - loop.time()) > 0:
            if store.watch_epoch != epoch:  # dropped: no final chunk, the connection just ends
                if raw.transport is not None:
                    raw.transport.abort()
                return response
            try:
                event = await asyncio.wait_for(queue.get(), timeout=min(TICK, remaining))
            except TimeoutError:
                if raw.transport is None or raw.transport.is_closing() or store.closed:
                    break
                if bookmarks and loop.time() - last_bookmark >= bookmark_interval:
                    await send('BOOKMARK', bookmark(store.rv))
                    last_bookmark = loop.time()
                continue
            if store.watch_epoch != epoch:
                continue  # dropped while waiting: cut above, this event not sent
            if relevant(event):
                typed = _transition(event, match)
                if typed:
                    await send(typed[0], store.render(rd, typed[1]))
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client went away
    finally:
        listeners.discard(queue.put_nowait)
    return response


def _transition(event: Event, match: Callable[[dict[str, Any]], bool]) -> tuple[str, dict[str, Any]] | None:
    """The event type and object as seen through a selector (objects entering/leaving the
    selection). One leaving it is DELETED with its previous content (the one that matched) and the
    edit's resourceVersion, as the API server's watch cache sends it."""
    now = match(event.object)
    if event.type != 'MODIFIED' or event.old is None:
        return (event.type, event.object) if now else None
    before = match(event.old)
    if now:
        return ('MODIFIED' if before else 'ADDED'), event.object
    if before:
        version = event.object['metadata']['resourceVersion']
        return 'DELETED', {**event.old, 'metadata': {**event.old['metadata'], 'resourceVersion': version}}
    return None
