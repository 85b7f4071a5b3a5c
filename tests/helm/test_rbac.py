"""Least privilege: the chart grants the operator exactly what its code and kopf use (derived in
tests/helm/rbac.py from the code), nothing more, no wildcards; namespaced installs hold no
namespaced permission cluster-wide."""

from __future__ import annotations

import ast
from typing import Any

import pytest

from tests.helm import rbac
from tests.helm.chart import NON_DEFAULT, ROOT, Rendered, expand_rules, render


def _needed_in_namespace() -> set[rbac.Triple]:
    return set(rbac.code_needs()) | rbac.escalation_needs() | rbac.owner_reference_needs()


def _no_wildcards(objects: tuple[dict[str, Any], ...]) -> None:
    for obj in objects:
        for rule in obj.get("rules", []) if obj["kind"] in ("Role", "ClusterRole") else []:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], (obj["metadata"]["name"], rule)
            assert not rule.get("nonResourceURLs"), rule
        if obj["kind"] == "ClusterRole":
            assert not obj.get("aggregationRule"), obj["metadata"]["name"]


def test_the_code_derivation_finds_what_the_operator_does() -> None:
    needs = rbac.code_needs()
    # sanity of the derivation itself: one call site of each sort was found
    assert ("", "pods", "list") in needs and ("", "secrets", "get") in needs
    assert ("mnnrollout.io", "modeldeployments/status", "update") in needs
    assert ("apps", "deployments", "create") in needs and ("apps", "deployments", "patch") in needs
    assert any("alerts.py" in w for w in needs[("mnnrollout.io", "modeldeployments", "list")])
    # children go by garbage collection; only an HPA the spec no longer asks for is deleted
    assert [t for t in needs if t[2] == "delete"] == [("autoscaling", "horizontalpodautoscalers", "delete")]
    assert ("", "configmaps", "watch") in rbac.escalation_needs()


def test_kopf_handlers_return_nothing_so_kopf_never_patches_status() -> None:
    """Why modeldeployments/status has no `patch`: kopf writes handler results into status only
    when a handler returns a value; its progress and diff-base live in annotations (main.py)."""
    tree = ast.parse((ROOT / "operator/rollout_operator/main.py").read_text())
    handlers = [f for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                and any("kopf.on." in ast.unparse(d) or "kopf.daemon" in ast.unparse(d) for d in f.decorator_list)
                and not any("startup" in ast.unparse(d) for d in f.decorator_list)]
    assert {f.name for f in handlers} >= {"observe", "modeldeployment_changed", "runtime_pod_changed", "forget"}
    for fn in handlers:
        for node in ast.walk(fn):
            if isinstance(node, ast.Return):
                assert node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None), \
                    f"kopf handler {fn.name} returns a value: kopf would patch status (grant patch on status)"
    source = (ROOT / "operator/rollout_operator/main.py").read_text()
    assert "AnnotationsProgressStorage" in source and "AnnotationsDiffBaseStorage" in source


def test_cluster_wide_install_grants_exactly_what_is_needed() -> None:
    r = render()
    _no_wildcards(r.objects)
    (role,) = r.of_kind("ClusterRole")
    granted = expand_rules(role["rules"])
    kopf = rbac.kopf_needs(cluster_wide=True)
    needed = _needed_in_namespace() | kopf["namespaced"] | kopf["cluster"]
    assert granted - needed == set(), f"granted but not needed: {sorted(granted - needed)}"
    assert needed - granted == set(), f"needed but not granted: {sorted(needed - granted)}"
    assert not r.of_kind("Role") and not r.of_kind("RoleBinding")
    (binding,) = r.of_kind("ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    sa = r.one("ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "mnn-rollout"}]
    assert r.deployment["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


@pytest.mark.parametrize("cluster_reads", [True, False])
def test_namespaced_install_grants_exactly_what_is_needed_per_namespace(cluster_reads: bool) -> None:
    values = {**NON_DEFAULT, "rbac": {"create": True, "clusterScopedReads": cluster_reads}}
    r: Rendered = render(values, name="prod", namespace="ops")
    _no_wildcards(r.objects)
    kopf = rbac.kopf_needs(cluster_wide=False)
    needed = _needed_in_namespace() | kopf["namespaced"]
    roles = {o["metadata"]["namespace"]: o for o in r.of_kind("Role")}
    assert set(roles) == set(values["watchNamespaces"])
    for ns, role in roles.items():
        granted = expand_rules(role["rules"])
        assert granted - needed == set(), f"{ns}: granted but not needed: {sorted(granted - needed)}"
        assert needed - granted == set(), f"{ns}: needed but not granted: {sorted(needed - granted)}"
        binding = r.one("RoleBinding") if len(roles) == 1 else next(
            b for b in r.of_kind("RoleBinding") if b["metadata"]["namespace"] == ns)
        assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] == role["metadata"]["name"]
    cluster_roles = r.of_kind("ClusterRole")
    if cluster_reads:
        (scanning,) = cluster_roles
        assert expand_rules(scanning["rules"]) == kopf["cluster"]
        assert all(verb in ("list", "watch") for _, _, verb in kopf["cluster"])  # reads only
        assert len(r.of_kind("ClusterRoleBinding")) == 1
    else:
        assert cluster_roles == [] and r.of_kind("ClusterRoleBinding") == []
    # the SA is bound to nothing else
    rules = rbac.bound_rules(r.objects, "ops", "prod-mnn-rollout")
    assert {ns for ns, _ in rules} == set(roles) | ({None} if cluster_reads else set())


def test_rbac_can_be_left_to_the_user() -> None:
    r = render({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "platform-operator"}})
    assert not [o for o in r.objects if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding",
                                                      "ServiceAccount")]
    assert r.deployment["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"


def test_the_authorizer_used_by_the_e2e_audit() -> None:
    r = render()
    rules = rbac.bound_rules(r.objects, "mnn-rollout", "mnn-rollout")
    assert rbac.allowed(rules, "apps", "deployments", "patch", "anywhere")
    assert not rbac.allowed(rules, "apps", "deployments", "update", "anywhere")
    assert not rbac.allowed(rules, "apps", "deployments", "delete", "anywhere")
    assert not rbac.allowed(rules, "", "secrets", "list", "default")
    assert rbac.request_verb({"method": "GET", "name": None, "query": {"watch": "true"}}) == "watch"
    assert rbac.request_verb({"method": "GET", "name": "x", "query": {}}) == "get"
    apply = {"method": "PATCH", "name": "x", "query": {}, "contentType": "application/apply-patch+yaml"}
    assert rbac.request_verbs({**apply, "code": 201}) == ["patch", "create"]  # an apply that created
    assert rbac.request_verbs({**apply, "code": 200}) == ["patch"]
