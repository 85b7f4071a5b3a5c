"""kopf (in-process, via kopf.testing.KopfRunner) against the emulator: handlers, finalizers, timers,
events, and peering between two operators."""
import logging
import time
from collections.abc import Callable
from typing import Any

import kopf
import pytest
from kopf.testing import KopfRunner

from testbed.k8s.harness import PEERING_CRD, WIDGET_CRD, EmulatorProcess
from .helpers import WIDGETS, ok

pytestmark = pytest.mark.timeout(60)
WIDGET = 'apiVersion: example.io/v1\nkind: Widget\nmetadata: {{name: {name}}}\nspec: {{size: {size}}}\n'


def widget_operator(url: str, tag: str, calls: list[tuple[str, str]]) -> kopf.OperatorRegistry:
    """A small operator in its own registry, logged in to the emulator explicitly."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True, token='emulator')  # cf. emu.connection_info()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 30
        # A timer caught mid-patch by a deletion is re-checked after this many seconds (default 60,
        # also on a real cluster): keep it short, or deleting an object can stall for a minute.
        settings.background.cancellation_polling = 0.3

    @kopf.on.create('example.io', 'v1', 'widgets', registry=registry)
    def created(name: str, body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        calls.append((tag, f'create {name}'))
        kopf.info(body, reason='WidgetCreated', message=f'{tag} created {name}')  # a core/v1 Event
        patch.status['phase'] = 'Created'

    @kopf.on.update('example.io', 'v1', 'widgets', registry=registry)
    def updated(name: str, spec: Any, patch: kopf.Patch, **_: Any) -> None:
        calls.append((tag, f'update {name}'))
        patch.status['phase'] = f'Updated-{spec["size"]}'

    @kopf.on.delete('example.io', 'v1', 'widgets', registry=registry)
    def deleted(name: str, **_: Any) -> None:
        calls.append((tag, f'delete {name}'))

    @kopf.timer('example.io', 'v1', 'widgets', interval=0.3, registry=registry)
    def ticked(name: str, patch: kopf.Patch, **_: Any) -> None:
        calls.append((tag, f'timer {name}'))
        patch.status['ticked'] = True

    return registry


def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, 'the condition was not met in time'
        time.sleep(0.05)


def status_of(emu: EmulatorProcess, name: str) -> dict[str, Any]:
    status, body = emu.request('GET', WIDGETS.format(ns='default') + f'/{name}')
    return body.get('status', {}) if status == 200 else {}


def test_kopf_operator_handles_create_update_timer_and_delete_with_its_finalizer(k8s_emulator_factory):
    emu = k8s_emulator_factory(crds=[WIDGET_CRD])
    calls: list[tuple[str, str]] = []
    with KopfRunner(['run', '-A', '--standalone', '--verbose'], registry=widget_operator(emu.url, 'op', calls),
                    timeout=30) as runner:
        emu.kubectl('apply', '--validate=false', '-f', '-', input=WIDGET.format(name='w1', size=3))
        eventually(lambda: status_of(emu, 'w1').get('phase') == 'Created')
        obj = ok(emu.request('GET', WIDGETS.format(ns='default') + '/w1'))
        assert obj['metadata']['finalizers'] == ['kopf.zalando.org/KopfFinalizerMarker']
        emu.kubectl('patch', 'wd', 'w1', '--type=merge', '-p', '{"spec":{"size":9}}')
        eventually(lambda: status_of(emu, 'w1').get('phase') == 'Updated-9')
        eventually(lambda: status_of(emu, 'w1').get('ticked'))
        events = eventually(lambda: ok(emu.request('GET', '/api/v1/namespaces/default/events'))['items'])
        assert [(e['reason'], e['involvedObject']['name'], e['type']) for e in events] == [
            ('WidgetCreated', 'w1', 'Normal')]
        emu.kubectl('delete', 'wd', 'w1', '--timeout=20s')
        assert emu.request('GET', WIDGETS.format(ns='default') + '/w1')[0] == 404
    assert runner.exit_code == 0 and runner.exception is None
    handled = [c for _, c in calls if not c.startswith('timer')]
    # The delete handler runs at least once, maybe more: when the deletion catches the timer mid-run, kopf
    # keeps its finalizer until the timer has exited, forgets the finished delete handler meanwhile, and
    # runs it again on the next cycle (kopf's own logic, as on a real cluster; handlers must be idempotent).
    assert handled[:2] == ['create w1', 'update w1'] and set(handled[2:]) == {'delete w1'}, handled
    log = emu.requests()
    json_patches = [r for r in log if r['contentType'] == 'application/json-patch+json']
    assert json_patches, 'kopf removes its finalizer with a JSON patch guarded by a resourceVersion test'
    assert any(r['method'] == 'POST' and r['resource'] == 'events' for r in log)


def test_two_kopf_operators_with_peering_only_the_higher_priority_one_acts(k8s_emulator_factory):
    emu = k8s_emulator_factory(crds=[WIDGET_CRD, PEERING_CRD])
    emu.kubectl('apply', '--validate=false', '-f', '-',
                input='apiVersion: kopf.dev/v1\nkind: ClusterKopfPeering\nmetadata: {name: widgets}\n')
    calls: list[tuple[str, str]] = []
    args = ['run', '-A', '--peering=widgets', '--verbose']
    high = KopfRunner(args + ['--priority=100'], registry=widget_operator(emu.url, 'high', calls), timeout=30)
    low = KopfRunner(args + ['--priority=10'], registry=widget_operator(emu.url, 'low', calls), timeout=30)
    peers = lambda: ok(emu.request('GET', '/apis/kopf.dev/v1/clusterkopfpeerings/widgets')).get('status', {})  # noqa
    high.__enter__()
    try:
        eventually(lambda: len(peers()) == 1)
        low.__enter__()
        try:
            eventually(lambda: len(peers()) == 2)  # both keep-alives are in the peering object's status
            emu.kubectl('apply', '--validate=false', '-f', '-', input=WIDGET.format(name='w1', size=1))
            eventually(lambda: status_of(emu, 'w1').get('phase') == 'Created')
            time.sleep(1.0)  # give the paused operator every chance to misbehave
            assert {tag for tag, _ in calls} == {'high'}
        except BaseException:
            low.__exit__(None, None, None)
            raise
    finally:
        high.__exit__(None, None, None)
    try:
        # The high-priority operator removed itself from the peering on exit: the other one resumes.
        eventually(lambda: len(peers()) == 1)
        emu.kubectl('apply', '--validate=false', '-f', '-', input=WIDGET.format(name='w2', size=1))
        eventually(lambda: status_of(emu, 'w2').get('phase') == 'Created')
    finally:
        low.__exit__(None, None, None)
    assert ('low', 'create w2') in calls and ('low', 'create w1') not in calls
    assert high.exception is None and low.exception is None
