"""Feedback in a cluster takes a token: ``spec.runtime.feedback.secretName`` names a Secret whose
key the kubelet gives the runtime container (the operator never reads it), and every pod then
counts feedback only from requests that carry it. Without the field the pods refuse feedback."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from testbed.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(300)

TOKEN = "f33dback-t0ken"
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
    cluster.start_operator()
    md = cluster.manifest("scorer.yaml")
    md["spec"]["runtime"]["feedback"] = {"secretName": "scorer-feedback", "key": "outcomes"}
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

    # Without the field the pods refuse feedback, saying how to enable it.
    md["spec"]["runtime"].pop("feedback")
    cluster.apply(md)
    names = {p.name for p in pods}
    wait_for(lambda: len(cluster.pods()) == 2 and not names & {p.name for p in cluster.pods()}, 120,
             "the pods rolled without the token")
    refused = feedback(cluster.pods()[0], {"id": "0123456789abcdef.v1", "value": 1}, TOKEN)
    assert refused.status_code == 403 and "spec.runtime.feedback.secretName" in refused.json()["error"], refused.text
