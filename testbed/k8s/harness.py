"""
Run the emulator as a subprocess for tests: ``EmulatorProcess`` starts
``python -m testbed.k8s.emulator`` on 127.0.0.1 with a free port, waits for ``READY <url>``, writes a
kubeconfig, and offers small helpers (kubectl, a kubernetes client, raw HTTP, the request log).

    with EmulatorProcess(crds=['crds/modeldeployment.yaml']) as emu:
        emu.kubectl('get', 'md')
        api = emu.api_client()          # kubernetes.client.ApiClient
        emu.write_requests()            # POST/PUT/PATCH/DELETE calls seen so far
"""
import json
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

from .kubeconfig import write_kubeconfig

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: the directory holding testbed/
HERE = pathlib.Path(__file__).resolve().parent
WIDGET_CRD = HERE / 'manifests' / 'widget-crd.yaml'
PEERING_CRD = HERE / 'peering-crd.yaml'
WRITE_METHODS = ('POST', 'PUT', 'PATCH', 'DELETE')


class EmulatorProcess:
    def __init__(self, crds: Iterable[str | os.PathLike[str]] = (), args: Sequence[str] = (),
                 startup_timeout: float = 30.0) -> None:
        self.crds = [str(c) for c in crds]
        self.args = list(args)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.url = ''
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix='k8s-emulator-'))
        self.kubeconfig_path = self.workdir / 'kubeconfig'
        self.cache_dir = self.workdir / 'kube-cache'
        self.stderr_path = self.workdir / 'emulator.stderr'

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> 'EmulatorProcess':
        cmd = [sys.executable, '-m', 'testbed.k8s.emulator', '--host', '127.0.0.1', '--port', '0']
        for crd in self.crds:
            cmd += ['--crd', crd]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')])))
        with open(self.stderr_path, 'w') as stderr:
            self.proc = subprocess.Popen(cmd + self.args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                         stderr=stderr, text=True)
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.startup_timeout
        line = ''
        while time.monotonic() < deadline and self.proc.poll() is None:
            if sel.select(timeout=0.1):
                line = self.proc.stdout.readline()
                if line.startswith('READY '):
                    break
        sel.close()
        if not line.startswith('READY '):
            self.stop()
            raise RuntimeError(f'the emulator did not start: {self.stderr()}')
        self.url = line.split(None, 1)[1].strip()
        write_kubeconfig(self.kubeconfig_path, self.url)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> 'EmulatorProcess':
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors='replace') if self.stderr_path.exists() else ''

    # --- clients ---------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment for kubectl/kopf subprocesses pointing at this emulator."""
        return dict(os.environ, KUBECONFIG=str(self.kubeconfig_path), KUBECACHEDIR=str(self.cache_dir))

    def kubectl(self, *args: str, check: bool = True, timeout: float = 30.0,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
        cmd = ['kubectl', f'--cache-dir={self.cache_dir}', *args]
        result = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f'{" ".join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}')
        return result

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient configured for this emulator (KUBECONFIG is not consulted)."""
        import kubernetes
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig_path))

    def request(self, method: str, path: str, body: Any = None, content_type: str = 'application/json',
                headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, Any]:
        """Raw HTTP: returns (status, parsed JSON or text); never raises on HTTP errors."""
        data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={'Content-Type': content_type, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as rsp:
                status, raw = rsp.status, rsp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors='replace')

    def requests(self) -> list[dict[str, Any]]:
        return self.request('GET', '/_emulator/requests')[1]

    def reset_requests(self) -> None:
        self.request('DELETE', '/_emulator/requests')

    def write_requests(self, resource: str | None = None) -> list[dict[str, Any]]:
        """The POST/PUT/PATCH/DELETE calls received so far, optionally for one plural only."""
        return [r for r in self.requests()
                if r['method'] in WRITE_METHODS and (resource is None or r['resource'] == resource)]

    def inject_fault(self, code: int = 500, method: str = '*', path: str = '', times: int = 1,
                     reason: str = 'InternalError', message: str = 'injected by the emulator',
                     retry_after: int | None = None, after: bool = False) -> None:
        """Make the next ``times`` API requests matching ``method`` and the ``path`` regex fail
        (``after``: carried out first, then answered with the fault; ``retry_after``: a Retry-After)."""
        body = {'code': code, 'method': method, 'path': path, 'times': times, 'reason': reason, 'message': message,
                'retryAfter': retry_after, 'after': after}
        status, answer = self.request('POST', '/_emulator/faults', body)
        assert status == 201, answer

    def drop_watches(self) -> None:
        """Cut every open watch stream, as a lost connection does."""
        assert self.request('POST', '/_emulator/drop-watches')[0] == 200

    def compact(self) -> None:
        """Forget the watch history: a watch resumed from an older resourceVersion gets 410 Gone."""
        assert self.request('POST', '/_emulator/compact')[0] == 200

    def connection_info(self) -> Any:
        """For an in-process kopf operator: ``@kopf.on.login() def login(**_): return emu.connection_info()``.

        (kopf's default login goes through the kubernetes client, which reads KUBECONFIG only once,
        when ``kubernetes`` is first imported - an explicit login handler avoids that trap.)
        """
        import kopf
        return kopf.ConnectionInfo(server=self.url, insecure=True, token='emulator-token')
