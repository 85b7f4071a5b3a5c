"""Every pod the chart runs (and the runtime pods its operator creates) is locked down: non-root
numeric user, read-only root filesystem, no privilege escalation, every capability dropped,
seccomp RuntimeDefault, writes only to an emptyDir /tmp."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.helm.chart import NON_DEFAULT, ROOT, render


POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def pod_specs(objects: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for obj in objects:
        if obj["kind"] in POD_KINDS:
            out.append((f"{obj['kind']}/{obj['metadata']['name']}", obj["spec"]["template"]["spec"]))
        elif obj["kind"] == "Pod":
            out.append((f"Pod/{obj['metadata']['name']}", obj["spec"]))
        elif obj["kind"] == "CronJob":
            out.append((f"CronJob/{obj['metadata']['name']}", obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
    return out


def assert_locked_down(where: str, pod: dict[str, Any]) -> None:
    psc = pod.get("securityContext") or {}
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        sc = c.get("securityContext") or {}
        here = f"{where} container {c['name']}"

        def effective(key: str) -> Any:
            return sc.get(key, psc.get(key))

        assert effective("runAsNonRoot") is True, here
        uid = effective("runAsUser")
        assert isinstance(uid, int) and uid > 0, f"{here}: runAsUser {uid!r} is not a numeric non-root UID"
        assert sc.get("readOnlyRootFilesystem") is True, here
        assert sc.get("allowPrivilegeEscalation") is False, here
        assert not sc.get("privileged"), here
        assert (sc.get("capabilities") or {}).get("drop") == ["ALL"], here
        assert not (sc.get("capabilities") or {}).get("add"), here
        assert effective("seccompProfile") == {"type": "RuntimeDefault"}, here
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        assert "emptyDir" in volumes[mounts["/tmp"]], f"{here}: /tmp must be a writable emptyDir"
        for path, name in mounts.items():
            assert "hostPath" not in volumes[name], here
            if path != "/tmp":
                assert next(m for m in c["volumeMounts"] if m["mountPath"] == path).get("readOnly") is True, \
                    f"{here}: {path} should be mounted read-only"


@pytest.mark.parametrize("values", [{}, NON_DEFAULT, {"webhook": {"enabled": False}}], ids=["defaults", "non-default",
                                                                                             "no-webhook"])
def test_every_pod_in_the_chart_is_locked_down(values: dict[str, Any]) -> None:
    specs = pod_specs(render(values).objects)
    assert [w for w, _ in specs] == ["Deployment/mnn-rollout"]
    for where, pod in specs:
        assert_locked_down(where, pod)
        assert pod["securityContext"]["runAsUser"] == 65532


def test_the_chart_uid_is_the_runtime_pods_uid() -> None:
    from rollout_operator.children import RUNTIME_UID

    pod = render().deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == RUNTIME_UID == pod["containers"][0]["securityContext"]["runAsUser"]


def test_the_runtime_pods_the_operator_creates_are_locked_down_too() -> None:
    from rollout_operator import children
    from rollout_operator.spec import parse_spec

    manifest = yaml.safe_load((ROOT / "examples/scorer-canary.yaml").read_text())
    spec = parse_spec(manifest["spec"])
    target = children.Target("scorer", "default")
    config = children.runtime_config(spec, "scorer", {"v1": 90, "v2": 10}, "v1", ["v1", "v2"])
    deployment = children.render_deployment(target, spec, config)
    assert_locked_down("runtime Deployment/scorer-runtime", deployment["spec"]["template"]["spec"])
