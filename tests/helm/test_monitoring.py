"""The optional monitoring objects: the PrometheusRule carries exactly the rules of
examples/prometheus-rules.yaml, the AlertmanagerConfig routes them to the webhook with the token
the operator reads, the monitors select what the operator creates, and the Grafana dashboard has
the panels it promises over metric names the code really exports (and PromQL promtool accepts)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import NON_DEFAULT, ROOT, render


ON = {"serviceMonitor": {"enabled": True}, "runtimeMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
      "alertmanagerConfig": {"enabled": True}, "grafanaDashboard": {"enabled": True}}
METRIC = re.compile(r"\b(mnn_[a-z0-9_]+)")


def exported_metric_names() -> set[str]:
    """Every sample name the runtime and the operator expose (histograms: _bucket/_sum/_count)."""
    from mnn_runtime.metrics import RuntimeMetrics
    from prometheus_client import generate_latest
    from rollout_operator.metrics import OperatorMetrics

    runtime = RuntimeMetrics("scorer")
    runtime.touch("v1")
    runtime.latency.labels("scorer", "v1").observe(0.01)
    runtime.weight.labels("scorer", "v1").set(1)
    runtime.loaded.labels("scorer", "v1").set(1)
    runtime.load_duration.labels("scorer", "v1").set(1)
    runtime.in_flight.labels("scorer", "v1").set(0)
    runtime.memory.labels("scorer", "v1").set(1)
    runtime.offloaded.labels("scorer", "v1").set(0)
    operator = OperatorMetrics()
    operator.set_state("ns", "scorer", operator_phase(), {"v1": 100}, 0)
    operator.rollbacks.labels("ns", "scorer", "x").inc()
    operator.promotions.labels("ns", "scorer", "x").inc()
    operator.verdicts.labels("ns", "scorer", "m", "pass").inc()
    operator.step_seconds.labels("ns", "scorer").observe(1)
    text = runtime.exposition().decode() + generate_latest(operator.registry).decode()  # with the process metrics
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def operator_phase() -> Any:
    from rollout_operator.status import Phase

    return Phase.PROGRESSING


def test_prometheus_rule_has_exactly_the_example_rules() -> None:
    rule = render(ON).one("PrometheusRule")
    example = yaml.safe_load((ROOT / "examples/prometheus-rules.yaml").read_text())
    assert rule["spec"]["groups"] == example["groups"]  # names, expr, for, labels, annotations


def test_alertmanager_config_routes_every_canary_alert_to_the_webhook_with_its_token() -> None:
    r = render(NON_DEFAULT, name="prod", namespace="ops")
    amc = r.one("AlertmanagerConfig")
    alerts = [rule["alert"] for g in r.one("PrometheusRule")["spec"]["groups"] for rule in g["rules"]]
    (matcher,) = amc["spec"]["route"]["matchers"]
    assert matcher["name"] == "alertname" and matcher["matchType"] == "=~"
    assert sorted(matcher["value"].split("|")) == sorted(alerts)
    (receiver,) = amc["spec"]["receivers"]
    assert amc["spec"]["route"]["receiver"] == receiver["name"]
    (hook,) = receiver["webhookConfigs"]
    webhook_svc = next(s for s in r.of_kind("Service") if s["metadata"]["labels"]["mnnrollout.io/service"] == "webhook")
    port = webhook_svc["spec"]["ports"][0]["port"]
    assert hook["url"] == f"http://{webhook_svc['metadata']['name']}.ops.svc:{port}/alerts"
    creds = hook["httpConfig"]["authorization"]["credentials"]
    token_file = next(a for a in r.operator_container["args"] if a.startswith("--webhook-token-file="))
    volume = next(v for v in r.deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    assert creds == {"name": volume["secret"]["secretName"], "key": "bearer"} and token_file.endswith("/bearer")
    # the operator groups alerts by these labels (operator/rollout_operator/alerts.py)
    assert {"model", "version"} <= set(amc["spec"]["route"]["groupBy"])


def test_monitors_select_the_operator_service_and_the_runtime_pods() -> None:
    from rollout_operator import children

    r = render(ON)
    sm = r.one("ServiceMonitor")
    metrics_svc = next(s for s in r.of_kind("Service")
                       if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items())
    assert metrics_svc["spec"]["ports"][0]["name"] == sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert len([s for s in r.of_kind("Service")
                if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]) == 1
    pm = r.one("PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    runtime_labels = children.labels(children.Target("scorer", "default"))
    assert pm["spec"]["selector"]["matchLabels"].items() <= runtime_labels.items()
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "runtime"
    relabel_source = pm["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["sourceLabels"][0]
    assert relabel_source == "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9]", "_", children.OWNER_LABEL)
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"  # children.render_deployment's port name
    assert not r.one("ServiceMonitor")["spec"].get("namespaceSelector", {}).get("any")


def _dashboard() -> dict[str, Any]:
    cm = render(ON).one("ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    return dict(json.loads(text))


def _exprs(panel: dict[str, Any]) -> list[str]:
    return [t["expr"] for t in panel.get("targets", [])]


def test_dashboard_has_the_promised_panels() -> None:
    dash = _dashboard()
    panels = {p["title"]: p for p in dash["panels"]}
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])

    def find(*needles: str) -> dict[str, Any]:
        return next(p for p in dash["panels"] if all(any(n in e for e in _exprs(p)) for n in needles))

    rate = find("rate(mnn_inference_requests_total")
    assert "version" in _exprs(rate)[0] and rate["fieldConfig"]["defaults"]["unit"] == "reqps"
    errors = find('outcome!="success"')
    assert errors["fieldConfig"]["defaults"]["unit"] == "percentunit"
    latency = find("histogram_quantile(0.5,", "histogram_quantile(0.99,")
    assert all("mnn_inference_duration_seconds_bucket" in e for e in _exprs(latency))
    weights = find("mnn_rollout_version_weight_percent", "mnn_version_traffic_weight_ratio")
    assert weights["fieldConfig"]["defaults"]["unit"] == "percent"
    phase = find("mnn_rollout_phase")
    assert phase["type"] == "state-timeline"
    memory = find("mnn_version_memory_bytes", "mnn_runtime_memory_pss_bytes")
    assert memory["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert find("mnn_version_load_duration_seconds")["fieldConfig"]["defaults"]["unit"] == "s"
    assert find("mnn_runtime_cpu_seconds_total", "mnn_runtime_processes")
    assert {"Request rate per version", "Error rate per version", "Latency p50 / p99 per version",
            "Traffic weight per version", "Rollout phase"} <= set(panels)
    variables = {v["name"] for v in dash["templating"]["list"]}
    for panel in dash["panels"]:
        for expr in _exprs(panel):
            for var in re.findall(r"\$(\w+)", expr):
                assert var.startswith("__") or var in variables, (panel["title"], var)


def test_dashboard_and_rules_use_only_metrics_the_code_exports() -> None:
    exported = exported_metric_names()
    used = {m for p in _dashboard()["panels"] for e in _exprs(p) for m in METRIC.findall(e)}
    used |= {m for g in render(ON).one("PrometheusRule")["spec"]["groups"] for r in g["rules"]
             for m in METRIC.findall(r["expr"])}
    assert used and used - exported == set(), f"not exported by the runtime or the operator: {used - exported}"


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is missing: it comes with the Debian package `prometheus` "
                    "(apt-get install -y --no-install-recommends prometheus)")
    return tool


def test_every_promql_expression_parses(tmp_path: Path) -> None:
    """promtool checks the PrometheusRule's rules as they are, and each dashboard query as a
    recording rule (Grafana's variables replaced by what they expand to)."""
    tool = _promtool()
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": render(ON).one("PrometheusRule")["spec"]["groups"]}))
    records = []
    for panel in _dashboard()["panels"]:
        for i, expr in enumerate(_exprs(panel)):
            expanded = (expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
                        .replace("$model", ".*").replace("$namespace", ".*").replace("$modeldeployment", ".*"))
            records.append({"record": f"dashboard:panel{panel['id']}:q{i}", "expr": expanded})
    dashboard_rules = tmp_path / "dashboard.yaml"
    dashboard_rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    out = subprocess.run([tool, "check", "rules", str(rules), str(dashboard_rules)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_monitoring_is_off_by_default() -> None:
    kinds = {o["kind"] for o in render().objects}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule", "AlertmanagerConfig", "ConfigMap"}
