"""The permissions the operator needs, derived from its code and from kopf's, as
{(apiGroup, resource, verb)} sets; and a tiny RBAC authorizer over rendered objects.

Derivation (read, not guessed):
* every call the operator's code makes on its Kubernetes client (``KubeClient``), found by walking
  the AST of operator/rollout_operator/ (ctl.py is the user's CLI, not the operator; kube.py is the
  client itself): the kind comes from the call's first argument and ``kube.RESOURCES``, the verb from
  the method (get, list, create, replace = update, patch, delete), ``apply`` of a child (a
  server-side apply: patch, and create when it creates, as the API server authorizes it) times
  every kind ``children.render_all`` renders (with and without ``runtime.autoscaling``), the apply
  that hands a Deployment's replicas over to an HPA (patch: the Deployment exists), ``delete`` of
  the optional children (``children.OPTIONAL_KINDS``), a raw ``request(METHOD, PATH)`` from its
  method and path;
* RBAC escalation prevention: the operator creates the runtime's Role, so it must hold every
  permission that Role grants;
* children carry ownerReferences with ``blockOwnerDeletion: true``: update on the owner's
  ``finalizers`` subresource (OwnerReferencesPermissionEnforcement);
* kopf 1.45 (resources named by kopf's own selectors in ``kopf._cogs.structs.references``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

from tests.helm.chart import ROOT

Triple = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)
OPERATOR_SRC = ROOT / "operator" / "rollout_operator"
NOT_THE_OPERATOR = {"ctl.py", "kube.py"}  # the user's CLI; the client implementation
VERB_OF_METHOD = {"get": "get", "list": "list", "create": "create", "replace": "update", "patch": "patch",
                  "delete": "delete"}
HTTP_VERB = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def group_resource(kind: str) -> tuple[str, str]:
    from rollout_operator.kube import RESOURCES

    prefix, plural = RESOURCES[kind]
    parts = prefix.strip("/").split("/")  # ["api", "v1"] or ["apis", group, version]
    return ("" if parts[0] == "api" else parts[1]), plural


def _path_group_resource(path: str) -> tuple[str, str, bool]:
    """/apis/G/V/[namespaces/NS/]PLURAL[/NAME] -> (G, PLURAL, has name)."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    return group, rest[0], len(rest) > 1


def _is_kube(node: ast.AST) -> bool:
    """``kube``, ``self.kube``, ``reconciler.kube``, ``KubeClient(...)`` ..."""
    if isinstance(node, ast.Name):
        return node.id == "kube"
    if isinstance(node, ast.Attribute):
        return node.attr == "kube"
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "KubeClient"
    return False


def _client_method_kinds(method: str) -> set[tuple[str, str]]:
    """(kind, verb) of the self.<verb>("Kind", ...) calls inside one KubeClient method."""
    tree = ast.parse((OPERATOR_SRC / "kube.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KubeClient")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    out = set()
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                and node.func.attr in VERB_OF_METHOD and node.args
                and isinstance(node.args[0], ast.Constant)):
            out.add((node.args[0].value, VERB_OF_METHOD[node.func.attr]))
    return out


def _children_kinds() -> set[str]:
    import yaml

    from rollout_operator import children
    from rollout_operator.spec import parse_spec

    manifest = yaml.safe_load((ROOT / "examples" / "scorer-canary.yaml").read_text())
    body = {"apiVersion": "mnnrollout.io/v1alpha1", "metadata": {"name": "scorer", "uid": "u"}}
    target = children.Target("scorer", "ns", children.owner_reference(body))
    kinds = set()
    for autoscaling in (None, {"maxReplicas": 4, "targetInFlightPerPod": 8}):
        runtime = {**manifest["spec"].get("runtime", {}), **({"autoscaling": autoscaling} if autoscaling else {})}
        spec = parse_spec({**manifest["spec"], "runtime": runtime})
        config = children.runtime_config(spec, "scorer", {"v1": 100, "v2": 0}, "v1", ["v1", "v2"])
        kinds |= {o["kind"] for o in children.render_all(target, spec, config)}
    return kinds


def code_needs() -> dict[Triple, list[str]]:
    """Every (group, resource, verb) the operator's own code uses -> where it is used."""
    needs: dict[Triple, list[str]] = {}

    def add(triples: Iterable[Triple], where: str) -> None:
        for t in triples:
            needs.setdefault(t, []).append(where)

    for path in sorted(OPERATOR_SRC.rglob("*.py")):
        if path.name in NOT_THE_OPERATOR and path.parent == OPERATOR_SRC:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_kube(node.value)):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno} kube.{node.attr}"
            call = next((c for c in ast.walk(tree) if isinstance(c, ast.Call) and c.func is node), None)
            method = node.attr
            if method in VERB_OF_METHOD:
                assert call is not None, where
                sub = next((k.value.value for k in call.keywords
                            if k.arg == "subresource" and isinstance(k.value, ast.Constant)), None)
                if call.args and isinstance(call.args[0], ast.Constant) and "Peering" in call.args[0].value:
                    continue  # peering.py lists kopf's peering objects where kopf itself does: kopf_needs
                if call.args and isinstance(call.args[0], ast.Constant):
                    group, plural = group_resource(call.args[0].value)
                elif method == "get" and path.name == "ports.py" and ast.unparse(call.args[0]) == "obj['kind']":
                    add([(*group_resource(kind), "get") for kind in _children_kinds()], where)  # a child
                    continue
                elif method == "delete" and path.name == "ports.py" and ast.unparse(call.args[0]) == "obj['kind']":
                    from rollout_operator.children import OPTIONAL_KINDS  # delete_children: the unrendered ones

                    add([(*group_resource(kind), "delete") for kind in OPTIONAL_KINDS], where)
                    continue
                elif method == "list" and path.name == "ports.py" and ast.unparse(call.args[0]) == "kind":
                    from rollout_operator.ports import SYNCED_KINDS  # WatchCache.sync lists each of these

                    add([(*group_resource(kind), "list") for kind in SYNCED_KINDS], where)
                    continue
                elif method == "replace" and sub == "status" and path.name == "ports.py":
                    group, plural = group_resource("ModelDeployment")  # store_status: the MD's own status
                else:
                    raise AssertionError(f"{where}: cannot tell the kind; teach tests/helm/rbac.py")
                add([(group, f"{plural}/{sub}" if sub else plural, VERB_OF_METHOD[method])], where)
            elif method in ("apply", "apply_created"):  # apply_created: the same apply, saying whether it created
                assert call is not None and path.name == "ports.py", where
                if ast.unparse(call.args[0]) == "handover":  # children.replicas_handover: an existing Deployment
                    add([(*group_resource("Deployment"), "patch")], where)
                    continue
                assert ast.unparse(call.args[0]) == "obj", where
                add([(*group_resource(kind), verb) for kind in _children_kinds() for verb in ("patch", "create")],
                    where)
            elif method == "secret_value":
                add([(*group_resource(kind), verb) for kind, verb in _client_method_kinds("secret_value")], where)
            elif method == "request":
                assert call is not None and all(isinstance(a, ast.Constant) for a in call.args[:2]), where
                http, url = call.args[0].value, call.args[1].value
                group, plural, named = _path_group_resource(url)
                verb = HTTP_VERB.get(http) or ("get" if named else "list")
                add([(group, plural, verb)], where)
            elif method in ("close", "stop", "http", "configuration", "writes", "path"):  # stop: no request
                continue
            else:
                raise AssertionError(f"{where}: KubeClient.{method} is not known to tests/helm/rbac.py")
    return needs


def escalation_needs() -> set[Triple]:
    """The runtime's Role grants these; RBAC lets the operator create it only if it holds them."""
    from rollout_operator import children

    role = next(o for o in children.render_rbac(children.Target("x", "ns")) if o["kind"] == "Role")
    out = set()
    for rule in role["rules"]:
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def owner_reference_needs() -> set[Triple]:
    from rollout_operator import children

    owner = dict(children.owner_reference({"apiVersion": "mnnrollout.io/v1alpha1",
                                           "metadata": {"name": "x", "uid": "u"}}))
    if not owner.get("blockOwnerDeletion"):
        return set()
    group, plural = group_resource(owner["kind"])
    return {(group, f"{plural}/finalizers", "update")}


def watched_by_handlers() -> set[tuple[str, str]]:
    """(group, plural) of every resource a kopf handler of the operator watches, read from kopf's
    registry after importing the handlers."""
    import kopf

    import rollout_operator.main  # noqa: F401  (registers the handlers)

    registry = kopf.get_default_registry()
    out = set()
    for part in (registry._watching, registry._spawning, registry._changing, registry._indexing):
        # the operator's own: a test's operator run in the same process may have left its handlers
        for handler in part.get_all_handlers():
            if not handler.fn.__module__.startswith("rollout_operator."):
                continue
            selector = handler.selector
            assert selector is not None, handler
            plural = selector.plural or selector.any_name
            assert selector.group is not None and plural, selector
            out.add((selector.group, plural))
    return out


def kopf_needs(cluster_wide: bool) -> dict[str, set[Triple]]:
    """kopf 1.45's own API use, split by scope: "namespaced" is needed in every watched namespace
    (or cluster-wide), "cluster" on cluster-scoped resources."""
    from kopf._cogs.structs import references as ref

    group, plural = group_resource("ModelDeployment")
    namespaced = {
        # watching the handled resource: an initial list, then a watch; patch: finalizer,
        # progress and last-handled-configuration annotations (all in metadata: the handlers
        # return nothing, so kopf never writes their results into status).
        (group, plural, "list"), (group, plural, "watch"), (group, plural, "patch"),
        # kopf.event() and kopf's own warnings: POST core/v1 events.
        (ref.EVENTS.group, ref.EVENTS.any_name, "create"),
    }
    # every other resource the operator's kopf handlers watch (main.py), e.g. the runtime pods
    namespaced |= {(group_of, plural_of, verb) for group_of, plural_of in watched_by_handlers()
                   for verb in ("list", "watch")}
    peering = ref.CLUSTER_PEERINGS_K if cluster_wide else ref.NAMESPACED_PEERINGS_K
    # peering: list + watch the peering object, merge-patch keep-alives into it.
    peerings = {(peering.group, peering.any_name, v) for v in ("list", "watch", "patch")}
    # scanning: list + watch CRDs (always); Namespaces only when given exact namespaces.
    cluster = {(ref.CRDS.group, ref.CRDS.any_name, "list"), (ref.CRDS.group, ref.CRDS.any_name, "watch")}
    if not cluster_wide:
        cluster |= {(ref.NAMESPACES.group, ref.NAMESPACES.any_name, v) for v in ("list", "watch")}
    if cluster_wide:
        return {"namespaced": namespaced, "cluster": cluster | peerings}
    return {"namespaced": namespaced | peerings, "cluster": cluster}


# -- a tiny RBAC authorizer over rendered objects --------------------------------------------------

def bound_rules(objects: Iterable[dict[str, Any]], sa_namespace: str,
                sa_name: str) -> list[tuple[str | None, dict[str, Any]]]:
    """(namespace or None for cluster-wide, rule) for every rule bound to the ServiceAccount."""
    objs = list(objects)
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objs if o["kind"] in ("Role", "ClusterRole")}
    out: list[tuple[str | None, dict[str, Any]]] = []
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa_name and s.get("namespace") == sa_namespace
                   for s in b["subjects"]):
            continue
        ns = b["metadata"].get("namespace") if b["kind"] == "RoleBinding" else None
        ref_kind = b["roleRef"]["kind"]
        role = roles[(ref_kind, ns if ref_kind == "Role" else None, b["roleRef"]["name"])]
        out.extend((ns, rule) for rule in role["rules"])
    return out


def allowed(rules: list[tuple[str | None, dict[str, Any]]], group: str, resource: str, verb: str,
            namespace: str | None, name: str | None = None) -> bool:
    for scope, rule in rules:
        if scope is not None and scope != namespace:
            continue
        if (group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
                and (not rule.get("resourceNames") or name in rule["resourceNames"])):
            return True
    return False


def request_verbs(req: dict[str, Any]) -> list[str]:
    """The verbs the API server authorizes a logged request as: a server-side apply that created
    its object (answered 201) is authorized as patch and as create."""
    verb = request_verb(req)
    if verb == "patch" and "apply-patch" in req.get("contentType", "") and req.get("code") == 201:
        return ["patch", "create"]
    return [verb]


def request_verb(req: dict[str, Any]) -> str:
    method, name, query = req["method"], req.get("name"), req.get("query") or {}
    if method == "GET":
        if str(query.get("watch", "")).lower() in ("1", "true"):
            return "watch"
        return "get" if name else "list"
    if method == "DELETE" and not name:
        return "deletecollection"
    return HTTP_VERB[method]
