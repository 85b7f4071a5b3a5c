"""Remote versions through the operator: ``s3://`` model files from a local S3-compatible server
(moto, checking signatures), with the keys in a Secret that only the kubelet reads. The operator
renders the endpoint, the region and the Secret's key refs into the pods; each pod downloads into
its own emptyDir, checks the digest, and serves; a canary is promoted from S3 under traffic; and a
canary whose file does not match its digest never gets a request: the rollout waits for it, says
why, and fails at its deadline with the stable version serving everyone throughout."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from mnn_rollout.local.traffic import Traffic
from testbed.cluster import Cluster, wait_for
from tests.s3_server import moto_s3

pytestmark = pytest.mark.timeout(300)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def from_s3(cluster: Cluster, env: dict[str, str], files: dict[str, bytes], **spec: Any) -> dict[str, Any]:
    """The example scorer with v1, v2 and v3 in bucket ``models``; v3 is v2's file named with v1's
    digest (a file that is not the one the spec names)."""
    obj = cluster.manifest("scorer.yaml")
    obj["spec"]["versions"] = [
        {"name": "v1", "uri": "s3://models/scorer/v1.mnn", "sha256": sha(files["v1"])},
        {"name": "v2", "uri": "s3://models/scorer/v2.mnn", "sha256": sha(files["v2"])},
        {"name": "v3", "uri": "s3://models/scorer/v2.mnn", "sha256": sha(files["v1"])}]
    obj["spec"].pop("weights")
    obj["spec"]["modelSource"] = {"s3": {"endpoint": env["AWS_ENDPOINT_URL"], "region": env["AWS_REGION"],
                                         "secretName": "model-store"}}
    obj["spec"].update(spec)
    return obj


def canary(version: str, deadline: int) -> dict[str, Any]:
    return {"canary": version, "progressDeadlineSeconds": deadline, "strategy": {
        "steps": [{"weight": 50, "pause": "2s"}], "scaleDownDelaySeconds": 2,
        "analysis": {"interval": "1s", "minRequests": 5, "failureLimit": 2,
                     "metrics": [{"name": "error-rate", "max": 0.05}]}}}


def pod_status(pod: Any) -> dict[str, Any]:
    return dict(httpx.get(f"{pod.url}/v2/models/scorer/status", timeout=5).json())


def test_s3_versions_roll_out_with_the_secrets_keys_and_a_file_off_its_digest_never_serves(
        cluster: Cluster, examples_dir: Path, tmp_path: Path) -> None:
    files = {v: (examples_dir / f"{v}.mnn").read_bytes() for v in ("v1", "v2")}
    with moto_s3(tmp_path / "s3", {f"scorer/{v}.mnn": data for v, data in files.items()}) as env:
        cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "model-store"},
                       "stringData": {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}})
        cluster.start_operator()
        cluster.apply(from_s3(cluster, env, files, stable="v1"))
        pods = cluster.wait_ready()
        wait_for(lambda: cluster.status().get("phase") == "Ready", 60, "phase Ready")
        for pod in pods:  # each pod downloaded v1 and v2 into its own emptyDir, checked against the digests
            versions = pod_status(pod)["versions"]
            assert versions["v1"]["ready"] and versions["v1"]["uri"] == "s3://models/scorer/v1.mnn", versions
            assert versions["v2"]["ready"] and not versions["v3"]["ready"], versions
            assert "sha256" in versions["v3"]["reason"] and sha(files["v1"]) in versions["v3"]["reason"], versions
            cache = pod.log_path.parent / f"{pod.name}.volumes" / "model-cache"
            assert sorted(p.name for p in cache.iterdir()) == sorted(
                f"{sha(files[v])}-{sha(f's3://models/scorer/{v}.mnn'.encode())[:16]}.mnn" for v in ("v1", "v2"))

        with Traffic(cluster.pods, users=400, rate=100, connections=2) as traffic:
            cluster.apply(from_s3(cluster, env, files, stable="v1", **canary("v2", 60)))
            wait_for(lambda: cluster.status().get("phase") == "Succeeded", 120, "v2 promoted", interval=0.2)
            st = cluster.status()
            assert st["stableVersion"] == "v2" and st["weights"] == {"v2": 100}, st

            # A canary whose file is not the one its digest names: never loaded, never routed.
            seen: set[tuple[str, ...]] = set()
            applied = time.monotonic()
            cluster.apply(from_s3(cluster, env, files, stable="v2", **canary("v3", 12)))

            def look() -> dict[str, Any]:
                st = cluster.status()
                seen.add(tuple(sorted(v for v, w in (st.get("weights") or {}).items() if w)))
                return st

            def failed() -> bool:
                return look().get("phase") == "Failed"

            def waiting_for_v3() -> str | None:
                message = str(look().get("message"))
                return message if message.startswith("waiting for v3: ") and "sha256" in message else None

            waiting = str(wait_for(waiting_for_v3, 30, "v3 waited for, the reason said", interval=0.2))
            wait_for(failed, 60, "v3 failed at its deadline", interval=0.2)
            time.sleep(1.0)
            since_applied = traffic.counts(applied)
        st = cluster.status()
    assert "sha256" in waiting and sha(files["v1"]) in waiting, waiting
    assert st["abortReason"].startswith("ProgressDeadlineExceeded: canary v3 not ready within 12s"), st
    assert seen == {("v2",)} and st["weights"] == {"v2": 100, "v3": 0}, (seen, st)
    # from the apply to a second after the deadline: every request on v2, and answered
    assert {v for v, _ in since_applied} == {"v2"} and {c for _, c in since_applied} == {200}, since_applied
    assert set(traffic.statuses()) == {200}, traffic.statuses()
    assert cluster.configmap_weights().get("v3", 0) == 0
