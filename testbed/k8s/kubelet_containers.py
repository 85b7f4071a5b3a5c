"""
One container of the kubelet stand-in (see ``kubelet.py``) = one local process, restarted in place
with back-off, with its probes, and ``Timing``: how the stand-in compresses Kubernetes time.

Every process runs in its own session/process group (so a container is killed as a whole,
workers included) under a tiny launcher that sets ``PR_SET_PDEATHSIG``, so nothing outlives the
kubelet thread that started it even if the test process dies hard.
"""
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .kubelet_env import ContainerConfigError, Fetch, container_env, expand, rewrite_host
from .kubelet_probes import run_probe

_LAUNCHER = ('import ctypes, os, sys\n'
             'ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n'
             'if os.getppid() != int(sys.argv[1]): os._exit(137)\n'
             'os.execvpe(sys.argv[2], sys.argv[2:], os.environ)\n')


def now_iso() -> str:
    return time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())


@dataclasses.dataclass
class Timing:
    """How the stand-in compresses Kubernetes time for tests."""
    probe_scale: float = 0.03       # probe periods/delays x this (10 s period -> 0.3 s)
    min_readiness_period: float = 0.2
    min_liveness_period: float = 0.5
    backoff_base: float = 0.5       # restart back-off: base * 2^(n-1), capped (real: 10 s .. 5 min)
    backoff_cap: float = 5.0
    backoff_reset: float = 10.0     # a container that ran this long starts the back-off afresh
    grace_cap: float = 30.0         # terminationGracePeriodSeconds is capped at this
    pre_stop: bool = True           # run preStop hooks (False: SIGTERM at once, a benchmark's baseline)


class Container:
    def __init__(self, pod: 'Any', spec: dict[str, Any], index: int, timing: Timing) -> None:
        self.pod, self.spec, self.index, self.timing = pod, spec, index, timing
        self.name = spec.get('name') or f'c{index}'
        self.ports = {p['name']: int(p['containerPort']) for p in spec.get('ports') or [] if p.get('name')}
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self.restarts = 0
        self.crashes = 0  # consecutive, for the back-off
        self.next_start = 0.0
        self.started_at: str | None = None
        self.started_mono = 0.0
        self.last_state: dict[str, Any] = {}
        self.waiting: tuple[str, str] | None = ('ContainerCreating', '')
        self.ready = False
        self.started = False  # startupProbe passed (or none)
        self._stop_probes: threading.Event | None = None
        self.full_env: dict[str, str] = {}  # what the process runs with (its hooks too)
        self._commands: dict[str, list[str]] = {}
        self._hook: threading.Thread | None = None  # the preStop hook, while it runs
        self._hook_proc: subprocess.Popen[bytes] | None = None
        self._hook_abort = threading.Event()
        self.term_sent = False  # SIGTERM went to the main process

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # --- start ---

    def argv(self, commands: dict[str, list[str]], entrypoint: list[str]) -> list[str]:
        command = [expand(c, self.env) for c in self.spec.get('command') or []]
        args = [expand(a, self.env) for a in self.spec.get('args') or []]
        return self.mapped((command or list(entrypoint)) + rewrite_host(args, self.pod.ip), commands)

    @staticmethod
    def mapped(argv: list[str], commands: dict[str, list[str]]) -> list[str]:
        """``argv`` with its program as this machine runs it (``commands``; ``python*``: this one)."""
        head = argv[0]
        if head in commands or os.path.basename(head) in commands:
            return commands.get(head, commands.get(os.path.basename(head), [])) + argv[1:]
        if os.path.basename(head) in ('python', 'python3', f'python{sys.version_info[0]}.{sys.version_info[1]}'):
            return [sys.executable] + argv[1:]
        return argv

    def start(self, fetch: Fetch, commands: dict[str, list[str]], entrypoint: list[str],
              base_env: dict[str, str], cwd: Path) -> None:
        try:
            self.env = self.pod.mounted_env(self.spec, container_env(self.spec, self.pod.manifest(), fetch))
        except ContainerConfigError as e:
            self.waiting = ('CreateContainerConfigError', str(e))
            self.next_start = time.monotonic() + self.timing.backoff_base
            return
        argv = self.argv(commands, entrypoint)
        env = self.full_env = {**base_env, **self.pod.tmp_env(self.spec), **self.env}
        self._commands = commands
        log = open(self.pod.log_path, 'ab')
        try:
            log.write(f'--- {now_iso()} kubelet: starting container {self.name} (restart {self.restarts}):'
                      f' {argv}\n'.encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, '-c', _LAUNCHER, str(os.getpid()), *argv], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=str(cwd), start_new_session=True)
        except OSError as e:
            self.waiting = ('RunContainerError', str(e))
            self.next_start = time.monotonic() + self.timing.backoff_base
            return
        finally:
            log.close()
        if self.last_state:
            self.restarts += 1
        self.waiting, self.ready = None, False
        self.started_at, self.started_mono = now_iso(), time.monotonic()
        self.started = 'startupProbe' not in self.spec
        self._stop_probes = threading.Event()
        threading.Thread(target=self._probe_loop, args=(self._stop_probes,), daemon=True,
                         name=f'probe-{self.pod.name}-{self.name}').start()

    # --- exit / stop ---

    def check_exit(self) -> bool:
        """Reap an exited process; returns True when it just exited (then schedules a restart)."""
        if self.proc is None or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        self._kill_group(signal.SIGKILL)  # the whole container goes, like its cgroup would
        exit_code = 128 - code if code < 0 else code
        self.last_state = {'terminated': {'exitCode': exit_code, 'reason': 'Completed' if code == 0 else 'Error',
                                          'startedAt': self.started_at, 'finishedAt': now_iso(),
                                          'containerID': f'process://{self.proc.pid}'}}
        if code < 0:
            self.last_state['terminated']['signal'] = -code
        ran = time.monotonic() - self.started_mono
        self.crashes = 1 if ran > self.timing.backoff_reset else self.crashes + 1
        delay = min(self.timing.backoff_cap, self.timing.backoff_base * 2 ** (self.crashes - 1))
        self.next_start = time.monotonic() + delay
        self.waiting = ('CrashLoopBackOff', f'back-off {delay:.1f}s restarting failed container={self.name}'
                                            f' pod={self.pod.name}')
        self._end_probes()
        self.proc = None
        return True

    def _end_probes(self) -> None:
        if self._stop_probes is not None:
            self._stop_probes.set()
        self.ready = False

    def _kill_group(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def signal(self, sig: int) -> int | None:
        pid = self.pid
        if pid is not None:
            os.kill(pid, sig)
        return pid

    def terminate(self) -> None:
        """Begin a graceful stop: the preStop hook (exec, httpGet or sleep) if there is one, then
        (``advance``) SIGTERM to the main process only, as a container runtime sends it."""
        self._end_probes()
        hook = (self.spec.get('lifecycle') or {}).get('preStop') if self.timing.pre_stop else None
        if hook and self.running:
            self._log(f'preStop hook: {hook}')
            self._hook = threading.Thread(target=self._pre_stop, args=(hook,), daemon=True,
                                          name=f'prestop-{self.pod.name}-{self.name}')
            self._hook.start()
        else:
            self.advance()

    def advance(self) -> None:
        """For a terminating container: SIGTERM once its preStop hook is done."""
        if not self.term_sent and (self._hook is None or not self._hook.is_alive()):
            self.term_sent = True
            self.signal(signal.SIGTERM)

    def _pre_stop(self, hook: dict[str, Any]) -> None:
        try:
            if 'exec' in hook:
                argv = self.mapped([expand(c, self.env) for c in hook['exec'].get('command') or []], self._commands)
                with open(self.pod.log_path, 'ab') as log:
                    self._hook_proc = subprocess.Popen(argv, env=self.full_env, stdout=log, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, start_new_session=True)
                code = self._hook_proc.wait()
                if code != 0:
                    self._log(f'preStop hook exited with {code}')
            elif 'httpGet' in hook:
                if not run_probe({'httpGet': hook['httpGet'], 'timeoutSeconds': self.pod.grace()}, self.pod.ip,
                                 self.ports, self.env):
                    self._log('preStop httpGet hook failed')
            elif 'sleep' in hook:
                self._hook_abort.wait(float(hook['sleep'].get('seconds') or 0))
        except (OSError, ValueError) as e:
            self._log(f'preStop hook failed: {e}')

    def _end_hook(self) -> None:
        self._hook_abort.set()
        if self._hook_proc is not None and self._hook_proc.poll() is None:
            try:
                os.killpg(self._hook_proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def quit(self) -> None:
        """SIGTERM to the whole container at once, no hook (the stand-in itself is stopping)."""
        self._end_probes()
        self._end_hook()
        self._kill_group(signal.SIGTERM)

    def kill(self) -> None:
        self._end_probes()
        self._end_hook()
        self._kill_group(signal.SIGKILL)

    def reap(self) -> bool:
        """For a terminating container: True once its process is gone."""
        if self.proc is None:
            self._end_hook()
            return True
        if self.proc.poll() is None:
            return False
        self._kill_group(signal.SIGKILL)
        self._end_hook()
        self.proc = None
        return True

    # --- probes ---

    def _period(self, probe: dict[str, Any], minimum: float) -> float:
        return max(minimum, float(probe.get('periodSeconds') or 10) * self.timing.probe_scale)

    def _probe_loop(self, stop: threading.Event) -> None:
        t = self.timing
        ip = self.pod.ip
        startup, readiness, liveness = (self.spec.get(k) for k in ('startupProbe', 'readinessProbe',
                                                                     'livenessProbe'))
        if startup:
            stop.wait(float(startup.get('initialDelaySeconds') or 0) * t.probe_scale)
            fails = 0
            while not stop.is_set():
                if run_probe(startup, ip, self.ports, self.env):
                    break
                fails += 1
                if fails >= int(startup.get('failureThreshold') or 3) and self.started_mono + 1 < time.monotonic():
                    self._log(f'startup probe failed {fails} times: killing')
                    self._kill_group(signal.SIGKILL)
                    return
                stop.wait(self._period(startup, t.min_readiness_period))
            self.started = True
        if not readiness:
            self.ready = not stop.is_set()
        start = time.monotonic()
        next_ready = start + (float(readiness.get('initialDelaySeconds') or 0) * t.probe_scale if readiness else 0)
        next_live = start + (float(liveness.get('initialDelaySeconds') or 0) * t.probe_scale if liveness else 0)
        r_ok = r_fail = l_fail = 0
        l_seen = False  # liveness failures count only once the container was live (an implicit startup probe)
        while not stop.is_set():
            now = time.monotonic()
            if readiness and now >= next_ready:
                if run_probe(readiness, ip, self.ports, self.env):
                    r_ok, r_fail = r_ok + 1, 0
                    if r_ok >= int(readiness.get('successThreshold') or 1) and not stop.is_set():
                        self.ready = True
                else:
                    r_ok, r_fail = 0, r_fail + 1
                    if r_fail >= int(readiness.get('failureThreshold') or 3):
                        self.ready = False
                next_ready = time.monotonic() + self._period(readiness, t.min_readiness_period)
            if liveness and now >= next_live:
                if run_probe(liveness, ip, self.ports, self.env):
                    l_seen, l_fail = True, 0
                elif l_seen:
                    l_fail += 1
                    if l_fail >= int(liveness.get('failureThreshold') or 3):
                        self._log(f'liveness probe failed {l_fail} times: killing')
                        self.ready = False
                        self._kill_group(signal.SIGKILL)
                        return
                next_live = time.monotonic() + self._period(liveness, t.min_liveness_period)
            stop.wait(0.05)
        self.ready = False

    def _log(self, message: str) -> None:
        with open(self.pod.log_path, 'ab') as f:
            f.write(f'--- {now_iso()} kubelet: {self.name}: {message}\n'.encode())

    # --- status ---

    def status(self) -> dict[str, Any]:
        state: dict[str, Any]
        if self.proc is not None:
            state = {'running': {'startedAt': self.started_at}}
        else:
            reason, message = self.waiting or ('ContainerCreating', '')
            state = {'waiting': {'reason': reason, **({'message': message} if message else {})}}
        return {
            'name': self.name, 'image': self.spec.get('image', ''), 'imageID': '',
            'containerID': f'process://{self.proc.pid}' if self.proc is not None else '',
            'ready': bool(self.ready and self.proc is not None), 'started': bool(self.started and self.proc),
            'restartCount': self.restarts, 'state': state, 'lastState': self.last_state,
        }
