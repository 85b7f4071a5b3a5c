"""``versions[].engine`` on the operator's side: the CRD and the contract agree, workers x threads
must fit the CPU limit, the pods get an emptyDir at each compile cache directory, the routing
ConfigMap carries the settings to the runtime, and a backend fallback the pods report becomes
one Warning Event per change."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from mnn_rollout.contract.config import EngineSpec
from rollout_operator import children
from rollout_operator.observe import Observation, PodView
from rollout_operator.reconcile import Reconciler
from rollout_operator.spec import SpecError, parse_spec
from rollout_operator.status import RolloutStatus
from testbed.k8s.schema import prune_and_default, validate

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "modeldeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
ENGINE = SCHEMA["properties"]["spec"]["properties"]["versions"]["items"]["properties"]["engine"]
TARGET = children.Target("scorer", "ml", children.owner_reference({"metadata": {"name": "scorer", "uid": "u-1"}}))


def spec(engine: dict[str, Any] | None = None, **runtime: Any) -> dict[str, Any]:
    v2: dict[str, Any] = {"name": "v2", "uri": "/m/v2.mnn"}
    if engine is not None:
        v2["engine"] = engine
    return {"versions": [{"name": "v1", "uri": "/m/v1.mnn"}, v2], "runtime": runtime}


def test_the_crd_engine_schema_matches_the_contract() -> None:
    fields = EngineSpec.model_fields
    props = ENGINE["properties"]
    assert set(props) == {f.alias or name for name, f in fields.items()}
    for name in ("backend", "precision", "memory", "power"):
        assert props[name]["enum"] == list(fields[name].annotation.__args__), name  # type: ignore[union-attr]
        assert props[name]["default"] == fields[name].default
    assert (props["threads"]["default"], props["threads"]["minimum"], props["threads"]["maximum"]) == (1, 1, 32)


@pytest.mark.parametrize(("engine", "field", "value"), [
    ({"backend": "GPU"}, "spec.versions.1.engine.backend", "GPU"),
    ({"threads": 0}, "spec.versions.1.engine.threads", "0"),
    ({"memory": "tiny"}, "spec.versions.1.engine.memory", "tiny"),
])
def test_bad_engine_settings_are_refused_by_the_crd_and_the_operator(engine: dict[str, Any], field: str,
                                                                     value: str) -> None:
    obj = {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "s"},
           "spec": spec(engine)}
    assert validate(obj, SCHEMA) != []
    with pytest.raises(SpecError) as err:
        parse_spec(obj["spec"])
    assert f"{field}: " in str(err.value) and value in str(err.value)


def test_the_crd_fills_the_engine_defaults_the_runtime_uses() -> None:
    obj = prune_and_default({"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment",
                             "metadata": {"name": "s"}, "spec": spec({"threads": 2})}, SCHEMA)
    assert parse_spec(obj["spec"]).versions[1].engine == EngineSpec(threads=2)


@pytest.mark.parametrize(("runtime", "message"), [
    ({"workers": 2, "resources": {"limits": {"cpu": "2"}}},
     "spec.versions.1.engine.threads: 2 (version 'v2') x runtime.workers 2 = 4 threads, more than "
     "runtime.resources.limits.cpu '2' allows (2 CPUs, rounded up)"),
    ({"resources": {"limits": {"cpu": "1"}}},
     "spec.versions.1.engine.threads: 2 (version 'v2') x 1 worker (the least) = 2 threads, more than "
     "runtime.resources.limits.cpu '1' allows (1 CPU, rounded up)"),
])
def test_workers_times_threads_above_the_cpu_limit_is_refused_naming_the_fields(runtime: dict[str, Any],
                                                                               message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec({"threads": 2}, **runtime))
    assert message in str(err.value)


@pytest.mark.parametrize(("runtime", "workers"), [
    ({"resources": {"limits": {"cpu": "4"}}}, "2"),  # no workers given: one per 2 CPUs
    ({"resources": {"limits": {"cpu": "3"}}}, "1"),
    ({"workers": 2, "resources": {"limits": {"cpu": "4"}}}, "2"),
    ({"workers": 8}, "8"),  # no CPU limit: nothing to check against
    ({"workers": 4, "resources": {"requests": {"cpu": "1"}}}, "4"),
    ({"resources": {"requests": {"cpu": "4"}}}, "2"),
])
def test_specs_that_fit_are_accepted_and_the_default_workers_leave_room_for_the_threads(
        runtime: dict[str, Any], workers: str) -> None:
    parsed = parse_spec(spec({"threads": 2}, **runtime))
    config = children.runtime_config(parsed, "scorer", {"v1": 100}, "v1", ["v1", "v2"])
    args = children.render_deployment(TARGET, parsed, config)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--workers") + 1] == workers


def test_one_thread_everywhere_keeps_todays_workers() -> None:
    parsed = parse_spec(spec(None, workers=4, resources={"limits": {"cpu": "2"}}))  # over the limit: as before
    assert parsed.max_threads() == 1
    assert children.workers_arg(None, {"limits": {"cpu": "3"}}) == "3"


def test_the_engine_settings_reach_the_runtime_config() -> None:
    parsed = parse_spec(spec({"backend": "OpenCL", "threads": 2, "cacheDir": "/var/cache/mnn"}))
    config = children.runtime_config(parsed, "scorer", {"v1": 100}, "v1", ["v1", "v2"])
    text = children.render_configmap(TARGET, config)["data"]["runtime.yaml"]
    v2 = yaml.safe_load(text)["versions"][1]
    assert v2["engine"] == {"backend": "OpenCL", "precision": "normal", "memory": "normal", "power": "normal",
                            "threads": 2, "cache_dir": "/var/cache/mnn"}
    assert "engine" not in yaml.safe_load(text)["versions"][0]  # no settings: nothing new in the ConfigMap


def pod_volumes(parsed: Any) -> tuple[dict[str, str], dict[str, Any]]:
    config = children.runtime_config(parsed, "scorer", {"v1": 100}, "v1", ["v1", "v2"])
    pod = children.render_deployment(TARGET, parsed, config)["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    return mounts, {v["name"]: v for v in pod["volumes"]}


def test_each_cache_dir_gets_an_empty_dir_unless_a_mount_holds_it_already() -> None:
    parsed = parse_spec({
        "versions": [
            {"name": "v1", "uri": "/m/v1.mnn", "engine": {"cacheDir": "/var/cache/mnn"}},
            {"name": "v2", "uri": "/m/v2.mnn", "engine": {"cacheDir": "/var/cache/mnn/"}},  # the same directory
            {"name": "v3", "uri": "/m/v3.mnn", "engine": {"cacheDir": "/cache/mine/v3"}},  # under the user's mount
            {"name": "v4", "uri": "/m/v4.mnn", "engine": {"cacheDir": "/tmp/mnn"}},  # under the runtime's /tmp
        ],
        "runtime": {"volumes": [{"name": "mine", "persistentVolumeClaim": {"claimName": "cache"}}],
                    "volumeMounts": [{"name": "mine", "mountPath": "/cache/mine"}]},
    })
    mounts, volumes = pod_volumes(parsed)
    assert set(mounts) == {"/tmp", "/cache/mine", "/var/cache/mnn"}
    assert volumes[mounts["/var/cache/mnn"]] == {"name": mounts["/var/cache/mnn"], "emptyDir": {}}
    assert volumes["mine"]["persistentVolumeClaim"] == {"claimName": "cache"}  # left as the user made it
    assert pod_volumes(parse_spec(spec(None)))[0].keys() == {"/tmp"}  # no cacheDir: nothing new


REMOTE = {"name": "v9", "uri": "https://example.com/v9.mnn", "sha256": "a" * 64}
USER_MOUNT = {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
              "volumeMounts": [{"name": "models", "mountPath": "/data/models"}]}


def cached(cache_dir: str, v2_uri: str = "/models/v2.mnn", **fields: Any) -> dict[str, Any]:
    """v1 at /models/v1.mnn with its compile cache at ``cache_dir``, v2 at ``v2_uri``."""
    return {"versions": [{"name": "v1", "uri": "/models/v1.mnn", "engine": {"cacheDir": cache_dir}},
                         {"name": "v2", "uri": v2_uri}], **fields}


@pytest.mark.parametrize(("raw", "message"), [
    # an emptyDir over the image's Python (on PATH) or its example models: the runtime could not start
    *((cached(d), f"spec.versions.0.engine.cacheDir: {d!r} would mount an empty volume over the image's {own}")
      for d, own in (("/opt", "/opt/venv"), ("/opt/venv", "/opt/venv"), ("/opt/mnn-rollout", "/opt/mnn-rollout"))),
    # an emptyDir over the models: every version would fail to load
    *((cached(d), f"spec.versions.0.engine.cacheDir: {d!r} holds the model file '/models/v1.mnn' of version 'v1'")
      for d in ("/models", "/models/", "//models/.")),
    (cached("/data", "file:///data/v2/v2.mnn"),
     "spec.versions.0.engine.cacheDir: '/data' holds the model file '/data/v2/v2.mnn' of version 'v2'"),
])
def test_a_cache_dir_that_would_break_the_pod_is_refused_naming_it_and_the_clashing_path(
        raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(raw)


@pytest.mark.parametrize(("raw", "emptydir"), [
    (cached("/var/cache/mnn-rollout"), "/var/cache/mnn-rollout"),  # no modelSource: nothing is mounted there
    (cached("/models/cache"), "/models/cache"),  # inside the models' directory, hiding none of them
    (cached("/data", "/data/models/v2.mnn", runtime=USER_MOUNT), "/data"),  # v2's deeper mount stays on top
    (cached("/data/models", "/data/models/v2.mnn", runtime=USER_MOUNT), None),  # in the user's volume: no emptyDir
    (cached("/tmp/mnn"), None),  # in the runtime's own /tmp
    (cached("/opt/cache"), "/opt/cache"),  # beside the image's directories, hiding neither
    # in the download cache of spec.modelSource: its volume holds it (its pruning keeps what it did not download)
    *((cached(d, modelSource={}), None) for d in ("/var/cache/mnn-rollout", "/var/cache/mnn-rollout/compile")),
])
def test_a_cache_dir_that_hides_no_model_is_accepted_and_mounted_once(raw: dict[str, Any],
                                                                       emptydir: str | None) -> None:
    parsed = parse_spec(raw)
    config = children.runtime_config(parsed, "scorer", {"v1": 100}, "v1", ["v1", "v2"])
    container = children.render_deployment(TARGET, parsed, config)["spec"]["template"]["spec"]["containers"][0]
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    assert len(paths) == len(set(paths))
    assert [path for _, path in children.cache_mounts(parsed)] == ([emptydir] if emptydir else [])


def test_the_pod_never_gets_two_mounts_at_one_path_even_from_a_spec_that_skipped_validation() -> None:
    parsed = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}, REMOTE], "modelSource": {}})
    engine = EngineSpec(cacheDir="/var/cache/mnn-rollout/")  # type: ignore[call-arg]
    unchecked = parsed.model_copy(update={"versions": [parsed.versions[0].model_copy(update={"engine": engine}),
                                                       parsed.versions[1]]})
    assert children.cache_mounts(unchecked) == []  # the download cache's emptyDir holds it


def observed(*engines: dict[str, Any] | None) -> Observation:
    pods = []
    for n, engine in enumerate(engines):
        state = {"ready": True, "state": "ready", "uri": "/m/v2.mnn", "sha256": None, "engine": engine}
        pods.append(PodView(f"pod-{n}", "127.0.0.9", 8080, True, {"versions": {"v2": state}}))
    return Observation(pods)


FALLBACK = {"requested_backend": "OpenCL", "backend": "CPU", "fallback": True, "threads": 1,
            "reason": "this node has no OpenCL backend (MNN: \"Can't Find\" it); runs on CPU"}
ON_CPU = {"requested_backend": "CPU", "backend": "CPU", "fallback": False, "threads": 1}


def status_with(observation: Observation) -> RolloutStatus:
    v2 = parse_spec(spec({"backend": "OpenCL"})).version("v2")
    return RolloutStatus(versions=[observation.version(v2).as_status()])


def test_the_status_shows_which_backend_the_pods_run_a_version_on() -> None:
    entry = status_with(observed(FALLBACK, FALLBACK)).versions[0]
    assert (entry["requestedBackend"], entry["backend"]) == ("OpenCL", "CPU")
    assert entry["engineFallback"].startswith("2 of 2 pods run it on CPU, not OpenCL: this node has no OpenCL")
    assert "backend" not in status_with(observed(ON_CPU, None)).versions[0]  # as asked: nothing more


def test_a_fallback_is_one_warning_event_per_change() -> None:
    none, fallen = RolloutStatus(), status_with(observed(FALLBACK, ON_CPU))
    events = Reconciler._engine_events(none, fallen)
    assert [(e.type, e.reason) for e in events] == [("Warning", "EngineFallback")]
    assert "version v2: requested backend OpenCL, runs on CPU (1 of 2 pods" in events[0].message
    assert Reconciler._engine_events(fallen, fallen) == []  # the next reconciles: said already
    assert Reconciler._engine_events(fallen, status_with(observed(FALLBACK, FALLBACK))) == []  # more pods: same change
    assert Reconciler._engine_events(fallen, status_with(observed(ON_CPU, ON_CPU))) == []  # gone: no warning
