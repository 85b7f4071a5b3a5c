"""The strategy's new shapes (issue 14): shadow steps, ``compare: stable`` metrics, A/B experiments.
The operator and the CRD refuse the same mistakes, naming the field and the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rollout_operator.sequential import SequentialTest
from rollout_operator.spec import SpecError, parse_spec
from rollout_operator.strategy import DEFAULT_SHADOW_METRIC, Series
from testbed.k8s.schema import prune_and_default, validate

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((ROOT / "crds" / "modeldeployment.yaml").read_text())["spec"]["versions"][0]["schema"][
    "openAPIV3Schema"]
VERSIONS = [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}, {"name": "v3", "uri": "v3.mnn"}]
CONVERSION = {"name": "conversion", "compare": "stable", "margin": 0.01}


def canary(steps: list[dict[str, Any]] | None = None, metrics: list[dict[str, Any]] | None = None,
           **more: Any) -> dict[str, Any]:
    strategy: dict[str, Any] = {"steps": steps or [{"weight": 10, "pause": "1m"}]}
    if metrics is not None:
        strategy["analysis"] = {"metrics": metrics}
    return {"versions": VERSIONS, "stable": "v1", "canary": "v2", "strategy": strategy, **more}


def ab(weights: dict[str, int] | None = None, metric: str = "conversion", metrics: list[dict[str, Any]] | None = None,
       **more: Any) -> dict[str, Any]:
    return {"versions": VERSIONS, "stable": "v1",
            "experiment": {"weights": weights or {"v1": 50, "v2": 50}, "metric": metric, **more},
            "strategy": {"analysis": {"metrics": metrics if metrics is not None else
                                      [{"name": "error-rate", "max": 0.05}, {**CONVERSION, "margin": 0,
                                                                             "effect": 0.01}]}}}


def crd_errors(spec: dict[str, Any]) -> list[tuple[str, str]]:
    obj = {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}, "spec": spec}
    return validate(prune_and_default(obj, SCHEMA), SCHEMA)


# -- shadow steps --------------------------------------------------------------------------------


def test_a_shadow_step_keeps_the_canary_at_weight_0_and_defaults_to_the_shadow_error_rate() -> None:
    spec = parse_spec(canary([{"shadow": 20, "pause": "2m"}, {"weight": 10, "pause": "1m"}],
                             [{"name": "error-rate", "max": 0.01}]))
    shadow, weighted = spec.strategy.steps
    assert (shadow.shadow, shadow.weight, shadow.pause_seconds) == (20, 0, 120.0)
    assert (weighted.shadow, weighted.weight) == (None, 10)
    analysis = spec.strategy.analysis
    assert analysis.metrics_for(shadow=True) == [DEFAULT_SHADOW_METRIC]
    assert (DEFAULT_SHADOW_METRIC.name, DEFAULT_SHADOW_METRIC.max) == ("shadow-error-rate", 0.05)
    assert [m.name for m in analysis.metrics_for(shadow=False)] == ["error-rate"]


def test_each_step_kind_is_judged_by_its_own_metrics() -> None:
    spec = parse_spec(canary([{"shadow": 50, "pause": "1m"}, {"weight": 10, "pause": "1m"}], [
        {"name": "error-rate", "max": 0.01}, {"name": "shadow-agreement", "min": 0.98},
        {"name": "shadow-latency-p99", "maxLatencyRatio": 2}, CONVERSION]))
    analysis = spec.strategy.analysis
    assert [m.name for m in analysis.metrics_for(shadow=True)] == ["shadow-agreement", "shadow-latency-p99"]
    assert [m.name for m in analysis.metrics_for(shadow=False)] == ["error-rate", "conversion"]


@pytest.mark.parametrize(("spec", "message"), [
    (canary([{"pause": "1m"}]), "spec.strategy.steps.0.weight: required (the canary's percent of traffic), or shadow"),
    (canary([{"shadow": 20, "weight": 10}]), "spec.strategy.steps.0.weight: 10 in a shadow step; a shadow step keeps "
                                             "the canary at weight 0"),
    (canary([{"shadow": 0}]), "spec.strategy.steps.0.shadow: Input should be greater than or equal to 1"),
    (canary([{"shadow": 101}]), "spec.strategy.steps.0.shadow: Input should be less than or equal to 100"),
    (canary([{"weight": 10}, {"shadow": 20}]), "spec.strategy.steps.1.shadow: a shadow step after step 0 gave the "
                                               "canary weight; shadow steps come first"),
    (canary([{"weight": 10}], [{"name": "shadow-agreement", "min": 0.98}, {"name": "error-rate", "max": 0.1}]),
     "shadow-agreement are read in shadow steps only, and no step is one"),
    (canary([{"shadow": 10}, {"weight": 10}], [{"name": "shadow-agreement", "min": 0.98}]),
     "only shadow metrics (shadow-agreement), but steps 1 give the canary weight"),
    (canary(metrics=[{"name": "shadow-error-rate", "max": 0.1, "maxErrorRateIncrease": 0.1}]),
     "maxErrorRateIncrease applies to error-rate, not 'shadow-error-rate'"),
    (canary([{"shadow": 10}], [{"name": "shadow-agreement", "min": 0.9, "query": "x"}]),
     "metric 'shadow-agreement' is built in: it takes no query or metric"),
])
def test_bad_shadow_steps_are_refused_naming_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert message in str(info.value), str(info.value)


def test_the_crd_takes_a_shadow_step_and_refuses_a_step_with_neither_or_both() -> None:
    assert crd_errors(canary([{"shadow": 20, "pause": "2m"}, {"weight": 10}])) == []
    assert any("needs weight" in m for _, m in crd_errors(canary([{"pause": "2m"}])))
    assert any("keeps the canary at weight 0" in m for _, m in crd_errors(canary([{"shadow": 20, "weight": 5}])))
    assert [p for p, _ in crd_errors(canary([{"shadow": 101}]))] == ["spec.strategy.steps[0].shadow"]


# -- compare: stable -----------------------------------------------------------------------------


def test_a_compare_metric_builds_its_sequential_test_and_reads_the_feedback_counters_by_default() -> None:
    spec = parse_spec(canary(metrics=[{"name": "revenue", "compare": "stable", "kind": "mean", "margin": 0.5,
                                       "relative": False, "confidence": 0.99, "minSamples": 200,
                                       "direction": "higher", "effect": 0.25}]))
    metric = spec.strategy.analysis.metrics[0]
    assert metric.test == SequentialTest(kind="mean", margin=0.5, confidence=0.99, direction="higher",
                                         min_samples=200, effect=0.25)
    assert metric.role_series() == {"n": Series("mnn_feedback_total"), "sum": Series("mnn_feedback_value_sum"),
                                    "squares": Series("mnn_feedback_value_squared_sum")}
    rate = parse_spec(canary(metrics=[CONVERSION])).strategy.analysis.metrics[0]
    assert rate.test == SequentialTest(kind="rate", margin=0.01)
    assert rate.role_series() == {"successes": Series("mnn_feedback_value_sum"), "trials": Series("mnn_feedback_total")}


def test_series_take_label_matchers_of_their_own_and_the_metrics_labels() -> None:
    metric = parse_spec(canary(metrics=[{**CONVERSION, "labels": {"tenant": "a"}, "series": {
        "trials": 'mnn_inference_requests_total{outcome="success"}'}}])).strategy.analysis.metrics[0]
    series = metric.role_series()
    assert series["trials"] == Series("mnn_inference_requests_total", (("outcome", "success"), ("tenant", "a")))
    assert series["successes"] == Series("mnn_feedback_value_sum", (("tenant", "a"),))
    assert series["trials"].matches("mnn_inference_requests_total", {"outcome": "success", "tenant": "a", "x": "y"})
    assert not series["trials"].matches("mnn_inference_requests_total", {"outcome": "client_error", "tenant": "a"})
    assert series["trials"].promql('model="m",version="v2"') == \
        'mnn_inference_requests_total{model="m",version="v2",outcome="success",tenant="a"}'


@pytest.mark.parametrize(("metric", "message"), [
    ({**CONVERSION, "minSamples": 1}, "spec.strategy.analysis.metrics.0.minSamples: 1 is not valid; valid: an "
                                      "integer >= 2"),
    ({**CONVERSION, "confidence": 1.0}, "spec.strategy.analysis.metrics.0.confidence: 1.0 is not valid; valid: at "
                                        "least 0.5 and below 1"),
    ({**CONVERSION, "margin": 0}, "spec.strategy.analysis.metrics.0.effect: required when margin is 0"),
    ({**CONVERSION, "margin": -0.1}, "spec.strategy.analysis.metrics.0.margin: -0.1 is not valid"),
    ({**CONVERSION, "bounds": [0, 1]}, "spec.strategy.analysis.metrics.0.bounds: (0.0, 1.0) is not valid; valid: "
                                       "(low, high) with low < high, for kind mean only"),
    ({**CONVERSION, "kind": "mean", "bounds": [1]}, "spec.strategy.analysis.metrics.0.bounds: [1.0] is not valid"),
    ({**CONVERSION, "kind": "median"}, "spec.strategy.analysis.metrics.0.kind: Input should be 'rate' or 'mean'"),
    ({**CONVERSION, "series": {"n": "mnn_feedback_total"}}, "spec.strategy.analysis.metrics.0.series.n: not a role "
                                                            "of kind rate; valid: successes, trials"),
    ({**CONVERSION, "series": {"trials": "not a series"}}, "spec.strategy.analysis.metrics.0.series.trials: 'not a "
                                                           "series' is not a series"),
    ({**CONVERSION, "max": 0.1}, "metric 'conversion': max do not apply with compare: stable"),
    ({**CONVERSION, "name": "error-rate"}, "metric 'error-rate' is built in; a compare: stable metric needs a name"),
    ({"name": "conv", "metric": "x_total", "max": 1, "margin": 0.1}, "metric 'conv': margin apply only with "
                                                                     "compare: stable"),
    ({**CONVERSION, "compare": "baseline"}, "spec.strategy.analysis.metrics.0.compare: Input should be 'stable'"),
])
def test_bad_compare_metrics_are_refused_with_the_specs_field_names(metric: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(canary(metrics=[metric]))
    assert message in str(info.value), str(info.value)


def test_two_compare_metrics_may_not_share_a_name() -> None:
    with pytest.raises(SpecError, match="metrics.1.name: 'conversion' is used by another metric"):
        parse_spec(canary(metrics=[CONVERSION, CONVERSION]))


def test_the_crd_takes_a_compare_metric_without_defaulting_its_fields_onto_other_metrics() -> None:
    spec = canary(metrics=[{"name": "error-rate", "max": 0.05}, {
        **CONVERSION, "kind": "mean", "direction": "lower", "confidence": 0.9, "minSamples": 50, "bounds": [0, 1],
        "relative": True, "effect": 0.02, "series": {"n": "mnn_feedback_total"}}])
    assert crd_errors(spec) == []
    stored = prune_and_default({"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment",
                                "metadata": {"name": "m"}, "spec": spec}, SCHEMA)
    assert stored["spec"]["strategy"]["analysis"]["metrics"][0] == {"name": "error-rate", "max": 0.05}
    parse_spec(stored["spec"])  # what the API server stores is what the operator accepts
    assert [p for p, _ in crd_errors(canary(metrics=[{**CONVERSION, "compare": "baseline"}]))] == [
        "spec.strategy.analysis.metrics[0].compare"]


# -- experiments ---------------------------------------------------------------------------------


def test_an_experiment_names_a_split_with_stable_and_a_compare_metric() -> None:
    spec = parse_spec(ab({"v1": 34, "v2": 33, "v3": 33}, maxDuration="2h"))
    assert spec.experiment is not None
    assert spec.experiment.weights == {"v1": 34, "v2": 33, "v3": 33} and spec.experiment.metric == "conversion"
    assert spec.experiment.duration_seconds(600) == 7200
    assert parse_spec(ab()).experiment.duration_seconds(600) == 600  # type: ignore[union-attr]
    assert crd_errors(ab({"v1": 34, "v2": 33, "v3": 33}, maxDuration="2h")) == []


@pytest.mark.parametrize(("spec", "message"), [
    (ab({"v2": 50, "v3": 50}), "spec.experiment.weights: {'v2': 50, 'v3': 50} gives stable 'v1' no traffic"),
    (ab({"v1": 100}), "spec.experiment.weights: {'v1': 100} has no challenger besides stable 'v1'"),
    (ab({"v1": 100, "v2": 0}), "spec.experiment.weights: v2 at 0; every version of an experiment takes traffic"),
    (ab({"v1": 50, "v2": 40}), "spec.experiment.weights: {'v1': 50, 'v2': 40} sum to 90; must sum to 100"),
    (ab({"v1": 50, "v9": 50}), "spec.experiment.weights.v9: 'v9' is not a listed version"),
    (ab(metric="error-rate"), "spec.experiment.metric: 'error-rate' is not a compare: stable metric of "
                              "strategy.analysis.metrics; valid: ['conversion']"),
    (ab(metrics=[{"name": "error-rate", "max": 0.05}]), "valid: none defined"),
    ({**ab(), "canary": "v2"}, "spec.experiment: set either experiment (an A/B test), canary (a progressive rollout) "
                               "or weights"),
    (ab(maxDuration="soon"), "spec.experiment.maxDuration: 'soon' is not a duration"),
])
def test_bad_experiments_are_refused_naming_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert message in str(info.value), str(info.value)


def test_the_crd_refuses_an_experiment_beside_a_canary_or_off_100() -> None:
    assert any("not two of them" in m for _, m in crd_errors({**ab(), "canary": "v2"}))
    assert any("must sum to 100" in m for _, m in crd_errors(ab({"v1": 50, "v2": 40})))


def test_the_crd_status_keeps_the_shadow_the_sequential_test_and_the_experiment() -> None:
    from rollout_operator.sequential import Counts, add_interval, compare, strata_counts

    strata = add_interval([], 0, Counts(20, 2), Counts(80, 9))
    entry = {"strata": strata, **compare(SequentialTest(margin=0.01), *strata_counts(strata)).as_status(),
             "margin": 0.01, "checkedAt": "2026-01-01T00:00:00.000Z"}
    assert entry["decision"] == "insufficient" and entry["estimate"] is None  # nulls, as the operator writes them
    status = {"phase": "Progressing", "shadowPercent": 20, "sequential": {"conversion": entry},
              "experiment": {"state": "Running", "weights": {"v1": 50, "v2": 50}, "comparisons": {"v2": entry}}}
    obj = {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"},
           "spec": canary(), "status": status}
    stored = prune_and_default(obj, SCHEMA)
    assert stored["status"] == status and validate(stored, SCHEMA) == []
    bad = {**status, "sequential": {"conversion": {**entry, "decision": "maybe"}}}
    assert [p for p, _ in validate({**obj, "status": bad}, SCHEMA)] == ["status.sequential.conversion.decision"]
