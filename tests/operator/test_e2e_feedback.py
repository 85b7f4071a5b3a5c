"""Feedback and profiling in a cluster take a token: ``spec.runtime.feedback.secretName`` (and
``runtime.admin``) names a Secret whose key the kubelet gives the runtime container (the operator
never reads it), and every pod then counts feedback (profiles a version) only for requests that
carry it. Without the fields the pods refuse both."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from testbed.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(300)

TOKEN, ADMIN = "f33dback-t0ken", "adm1n-t0ken"
BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


def feedback(pod: Any, items: object, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{pod.url}/v2/models/scorer/feedback", json=items, headers=headers, timeout=5)


def counted(pod: Any, version: str) -> float:
    text = httpx.get(f"{pod.url}/metrics", timeout=5).text
    line = f'mnn_feedback_total{{model="scorer",version="{version}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_the_pods_count_feedback_only_with_the_token_from_the_secret(cluster: Cluster) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "scorer-feedback"},
                   "stringData": {"outcomes": TOKEN}})
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "scorer-admin"},
                   "stringData": {"token": ADMIN}})
    cluster.start_operator()
    md = cluster.manifest("scorer.yaml")
    md["spec"]["runtime"]["feedback"] = {"secretName": "scorer-feedback", "key": "outcomes"}
    md["spec"]["runtime"]["admin"] = {"secretName": "scorer-admin"}
    cluster.apply(md)
    pods = cluster.wait_ready()
    wait_for(lambda: cluster.status().get("phase") == "Ready", 60, "phase Ready")
    for pod in pods:
        answer = httpx.post(f"{pod.url}/v2/models/scorer/infer", json=BODY, timeout=5).json()
        item = {"id": answer["id"], "value": 1}
        assert answer["model_version"] == "v1", answer
        before = counted(pod, "v1")
        refused = feedback(pod, item)
        assert refused.status_code == 401 and "feedback token" in refused.json()["error"], refused.text
        assert feedback(pod, item, "not-" + TOKEN).status_code == 401
        assert counted(pod, "v1") == before  # neither was counted
        taken = feedback(pod, item, TOKEN)
        assert taken.status_code == 200 and taken.json() == {"counted": 1, "unmatched": 0}, taken.text
        assert counted(pod, "v1") == before + 1
        profile = f"{pod.url}/v2/models/scorer/versions/v1/profile?runs=2"
        assert httpx.get(profile, timeout=30).status_code == 401
        assert httpx.get(profile, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).status_code == 401
        timed = httpx.get(profile, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        assert timed.status_code == 200 and timed.json()["ops"], timed.text

    # Without the fields the pods refuse feedback and profiling, saying how to enable them.
    md["spec"]["runtime"].pop("feedback")
    md["spec"]["runtime"].pop("admin")
    cluster.apply(md)
    names = {p.name for p in pods}
    wait_for(lambda: len(cluster.pods()) == 2 and not names & {p.name for p in cluster.pods()}, 120,
             "the pods rolled without the token")
    refused = feedback(cluster.pods()[0], {"id": "0123456789abcdef.v1", "value": 1}, TOKEN)
    assert refused.status_code == 403 and "spec.runtime.feedback.secretName" in refused.json()["error"], refused.text
    off = httpx.get(f"{cluster.pods()[0].url}/v2/models/scorer/versions/v1/profile", timeout=30,
                    headers={"Authorization": f"Bearer {ADMIN}"})
    assert off.status_code == 403 and "spec.runtime.admin.secretName" in off.json()["error"], off.text
