"""Watch streams: format, resumption, 410 Gone, timeouts, bookmarks, selectors, cluster-wide."""
import http.client
import threading
import time

import pytest

from .helpers import CONFIGMAPS, WIDGETS, configmap, create_namespace, ok, unique, watch, widget

pytestmark = pytest.mark.timeout(30)
MERGE = 'application/merge-patch+json'


def test_watch_streams_json_lines_as_application_json(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('a')), 201)
    rsp, events = watch(api, WIDGETS.format(ns=ns), {'timeoutSeconds': '5'}, max_events=1)
    assert rsp.status == 200 and rsp.getheader('Content-Type') == 'application/json'
    assert [(e['type'], e['object']['metadata']['name']) for e in events] == [('ADDED', 'a')]
    assert events[0]['object']['kind'] == 'Widget' and events[0]['object']['apiVersion'] == 'example.io/v1'


def test_watch_from_a_list_resource_version_loses_no_events(api, ns):
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('before')), 201)
    rv = ok(api.request('GET', CONFIGMAPS.format(ns=ns)))['metadata']['resourceVersion']
    # Changes between the list and the watch: the watch must replay them, and only them.
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('between')), 201)
    ok(api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/before', {'data': {'x': '1'}}, MERGE))
    ok(api.request('DELETE', CONFIGMAPS.format(ns=ns) + '/before'))

    def later() -> None:
        time.sleep(0.3)
        api.request('POST', CONFIGMAPS.format(ns=ns), configmap('during'))
    threading.Thread(target=later).start()
    _, events = watch(api, CONFIGMAPS.format(ns=ns), {'resourceVersion': rv, 'timeoutSeconds': '10'}, max_events=4)
    assert [(e['type'], e['object']['metadata']['name']) for e in events] == [
        ('ADDED', 'between'), ('MODIFIED', 'before'), ('DELETED', 'before'), ('ADDED', 'during')]
    rvs = [int(e['object']['metadata']['resourceVersion']) for e in events]
    assert rvs == sorted(rvs) and rvs[0] > int(rv)


def test_watch_from_a_compacted_resource_version_gets_a_410_gone_error_event(k8s_emulator_factory):
    emu = k8s_emulator_factory(args=['--history-size', '3'])
    first = ok(emu.request('POST', CONFIGMAPS.format(ns='default'), configmap('c0')), 201)
    for n in range(1, 6):
        ok(emu.request('POST', CONFIGMAPS.format(ns='default'), configmap(f'c{n}')), 201)
    rsp, events = watch(emu, CONFIGMAPS.format(ns='default'),
                        {'resourceVersion': first['metadata']['resourceVersion'], 'timeoutSeconds': '5'})
    assert rsp.status == 200 and len(events) == 1 and events[0]['type'] == 'ERROR'
    assert events[0]['object']['kind'] == 'Status' and events[0]['object']['code'] == 410
    assert events[0]['object']['reason'] == 'Expired'
    latest = ok(emu.request('GET', CONFIGMAPS.format(ns='default')))['metadata']['resourceVersion']
    ok(emu.request('POST', '/_emulator/compact'))
    _, events = watch(emu, CONFIGMAPS.format(ns='default'), {'resourceVersion': latest, 'timeoutSeconds': '1'})
    assert events == []  # still valid: nothing happened since


def test_watch_timeout_seconds_ends_the_stream(api, ns):
    started = time.monotonic()
    rsp, events = watch(api, CONFIGMAPS.format(ns=ns), {'timeoutSeconds': '1', 'resourceVersion': '0'})
    assert events == [] and 0.9 <= time.monotonic() - started < 3


def test_watch_bookmarks_are_sent_when_allowed_and_initial_events_end_with_a_bookmark(k8s_emulator_factory):
    emu = k8s_emulator_factory(args=['--bookmark-interval', '0.3'])
    ok(emu.request('POST', CONFIGMAPS.format(ns='default'), configmap('x')), 201)
    _, events = watch(emu, CONFIGMAPS.format(ns='default'), {
        'allowWatchBookmarks': 'true', 'sendInitialEvents': 'true', 'resourceVersionMatch': 'NotOlderThan',
        'timeoutSeconds': '2'})
    assert [e['type'] for e in events[:2]] == ['ADDED', 'BOOKMARK']
    assert events[1]['object']['metadata']['annotations'] == {'k8s.io/initial-events-end': 'true'}
    assert events[1]['object']['kind'] == 'ConfigMap'
    assert sum(e['type'] == 'BOOKMARK' for e in events) >= 3
    _, plain = watch(emu, CONFIGMAPS.format(ns='default'), {'timeoutSeconds': '1'})
    assert [e['type'] for e in plain] == ['ADDED']


def test_watch_with_a_selector_sees_objects_enter_and_leave_the_selection(api, ns):
    rv = ok(api.request('GET', CONFIGMAPS.format(ns=ns)))['metadata']['resourceVersion']
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('s', labels={'on': 'no'})), 201)
    ok(api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/s', {'metadata': {'labels': {'on': 'yes'}}}, MERGE))
    ok(api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/s', {'data': {'k': 'v'}}, MERGE))
    ok(api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/s', {'metadata': {'labels': {'on': 'no'}}}, MERGE))
    _, events = watch(api, CONFIGMAPS.format(ns=ns), {'resourceVersion': rv, 'labelSelector': 'on=yes',
                                                      'timeoutSeconds': '1'})
    assert [e['type'] for e in events] == ['ADDED', 'MODIFIED', 'DELETED']


def test_cluster_wide_lists_and_watches_cover_all_namespaces(api):
    ns1, ns2 = create_namespace(api, unique('cw')), create_namespace(api, unique('cw'))
    rv = ok(api.request('GET', '/apis/example.io/v1/widgets'))['metadata']['resourceVersion']
    ok(api.request('POST', WIDGETS.format(ns=ns1), widget('w')), 201)
    ok(api.request('POST', WIDGETS.format(ns=ns2), widget('w')), 201)
    listed = ok(api.request('GET', '/apis/example.io/v1/widgets'))
    assert {(ns1, 'w'), (ns2, 'w')} <= {(i['metadata']['namespace'], i['metadata']['name']) for i in listed['items']}
    _, events = watch(api, '/apis/example.io/v1/widgets', {'resourceVersion': rv, 'timeoutSeconds': '1'})
    assert [(e['object']['metadata']['namespace'], e['type']) for e in events] == [(ns1, 'ADDED'), (ns2, 'ADDED')]
    _, named = watch(api, WIDGETS.format(ns=ns1) + '/w', {'timeoutSeconds': '5'}, max_events=1)
    assert [e['object']['metadata']['name'] for e in named] == ['w']


def test_watch_as_table_sends_column_definitions_once(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('a')), 201)
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('b')), 201)
    _, events = watch(api, WIDGETS.format(ns=ns), {'timeoutSeconds': '5'}, max_events=2,
                      headers={'Accept': 'application/json;as=Table;v=v1;g=meta.k8s.io'})
    assert [e['object']['kind'] for e in events] == ['Table', 'Table']
    assert 'columnDefinitions' in events[0]['object'] and 'columnDefinitions' not in events[1]['object']
    assert events[1]['object']['rows'][0]['cells'][:2] == ['b', 1]


def test_dropped_watches_end_abruptly_and_a_resumed_watch_misses_nothing(api, ns):
    """``POST /_emulator/drop-watches`` cuts open streams mid-way (no final chunk), like a lost
    connection; a watch resumed from the last resourceVersion seen gets what happened meanwhile."""
    import threading
    seen = ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('d0')), 201)['metadata']['resourceVersion']
    outcome: dict = {}

    def follow() -> None:
        started = time.monotonic()
        try:
            outcome['events'] = watch(api, CONFIGMAPS.format(ns=ns), {'resourceVersion': seen,
                                                                      'timeoutSeconds': '30'})[1]
        except (http.client.IncompleteRead, ConnectionError):
            outcome['events'] = []
        outcome['after'] = time.monotonic() - started

    thread = threading.Thread(target=follow)
    thread.start()
    time.sleep(0.5)
    ok(api.request('POST', '/_emulator/drop-watches'))
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('d1')), 201)
    thread.join(10)
    assert outcome['events'] == [] and outcome['after'] < 5, outcome  # cut long before its 30 s timeout
    _, events = watch(api, CONFIGMAPS.format(ns=ns), {'resourceVersion': seen, 'timeoutSeconds': '1'})
    assert [e['object']['metadata']['name'] for e in events] == ['d1']
