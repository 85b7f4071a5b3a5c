"""The runtime config: every bad field is refused with a message naming field, value and what is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from mnn_rollout.contract.config import ConfigError, dump_config, load_config_file, parse_config, parse_config_text

GOOD = {
    "model": "scorer",
    "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "file:///models/v2.mnn"}],
    "weights": {"v1": 90, "v2": 10},
}


def with_(**changes: object) -> dict[str, object]:
    return {**GOOD, **changes}


def test_a_good_config_parses_with_defaults() -> None:
    config = parse_config(GOOD)
    assert config.stable_version == "v1"
    assert config.salt == "scorer"
    assert config.routing.header == "X-User-Id"
    assert config.routing.parameter == "user_id"
    assert config.effective_weights() == {"v1": 90, "v2": 10}


def test_without_weights_the_stable_version_gets_everything() -> None:
    config = parse_config(with_(weights={}, stable="v2"))
    assert config.effective_weights() == {"v1": 0, "v2": 100}


@pytest.mark.parametrize("uri", ["https://models.example.com/scorer/v1.mnn?version=3", "s3://models/scorer/v1.mnn",
                                 "s3://my.models-2/a/b/v1.mnn", "http://127.0.0.1:8000/v1.mnn", "http://[::1]/v1.mnn",
                                 "http://localhost/v1.mnn"])
def test_remote_uris_with_a_digest_are_accepted(uri: str) -> None:
    config = parse_config(with_(versions=[{"name": "v1", "uri": uri, "sha256": "a" * 64}], weights={}))
    assert config.versions[0].remote
    assert not parse_config(GOOD).versions[0].remote


def test_file_uris_and_relative_paths_resolve() -> None:
    config = parse_config(GOOD)
    assert config.versions[0].path(Path("/base")) == Path("/base/v1.mnn")
    assert config.versions[1].path(Path("/base")) == Path("/models/v2.mnn")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"weights": {"v1": 120, "v2": -20}}, ["weights.v1", "120", "0-100"]),
        ({"weights": {"v1": 90, "v2": 20}}, ["weights", "sum to 110", "100"]),
        ({"weights": {"v1": 90, "v3": 10}}, ["weights.v3", "'v3'", "not a listed version", "['v1', 'v2']"]),
        ({"versions": [{"name": "v1", "uri": "a.mnn"}, {"name": "v1", "uri": "b.mnn"}], "weights": {}},
         ["duplicate version names", "['v1']"]),
        ({"versions": [{"name": "V_1", "uri": "a.mnn"}], "weights": {}}, ["versions.0.name", "'V_1'", "DNS-1123"]),
        ({"versions": [{"name": "v1", "uri": "gs://bucket/v1.mnn"}], "weights": {}},
         ["versions.0.uri", "gs://bucket/v1.mnn", "unsupported scheme 'gs'", "file://, https://HOST/PATH or s3://"]),
        ({"versions": [{"name": "v1", "uri": "https://models.example.com/v1.mnn"}], "weights": {}},
         ["versions.0.sha256", "required for the remote uri 'https://models.example.com/v1.mnn'", "64 lowercase hex"]),
        ({"versions": [{"name": "v1", "uri": "s3://models/v1.mnn"}], "weights": {}},
         ["versions.0.sha256", "required for the remote uri 's3://models/v1.mnn'"]),
        ({"versions": [{"name": "v1", "uri": "s3://models/", "sha256": "a" * 64}], "weights": {}},
         ["versions.0.uri", "'s3://models/'", "is not s3://BUCKET/KEY"]),
        ({"versions": [{"name": "v1", "uri": "s3://Models_2/v1.mnn", "sha256": "a" * 64}], "weights": {}},
         ["versions.0.uri", "'s3://Models_2/v1.mnn'", "is not s3://BUCKET/KEY", "bucket name of 3-63"]),
        ({"versions": [{"name": "v1", "uri": "http://models.example.com/v1.mnn", "sha256": "a" * 64}], "weights": {}},
         ["versions.0.uri", "plain http to 'models.example.com'", "valid: https://", "loopback"]),
        ({"versions": [{"name": "v1", "uri": "https://user:pw@models.example.com/v1.mnn", "sha256": "a" * 64}],
          "weights": {}}, ["versions.0.uri", "carries a user or password", "Secret"]),
        ({"versions": [{"name": "v1", "uri": "https:///v1.mnn", "sha256": "a" * 64}], "weights": {}},
         ["versions.0.uri", "names no host"]),
        ({"versions": [{"name": "v1", "uri": "  "}], "weights": {}}, ["versions.0.uri", "empty"]),
        ({"versions": [{"name": "v1", "uri": "v1.mnn", "sha256": "abc"}], "weights": {}},
         ["versions.0.sha256", "'abc'", "64 lowercase hex"]),
        ({"versions": []}, ["versions", "at least 1"]),
        ({"stable": "v9"}, ["stable", "'v9'", "not a listed version"]),
        ({"routing": {"header": "X User"}}, ["routing.header", "'X User'"]),
        ({"server": {"max_body_bytes": 10}}, ["server.max_body_bytes", "1024"]),
        ({"model": "bad model!"}, ["model", "'bad model!'"]),
        ({"extra_field": 1}, ["extra_field", "not permitted"]),
        ({"weights": {"v1": "ninety", "v2": 10}}, ["weights.v1", "ninety"]),
    ],
)
def test_invalid_configs_are_refused_naming_field_and_value(change: dict[str, object], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_(**change))
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_missing_required_field_is_named() -> None:
    with pytest.raises(ConfigError, match="versions: Field required"):
        parse_config({"model": "scorer"})


def test_yaml_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError, match="expected a mapping, got list"):
        parse_config_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config_text("model: [unclosed\n")


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config_file(tmp_path / "nope.yaml")


def test_dump_and_parse_round_trip() -> None:
    config = parse_config(GOOD)
    assert parse_config_text(dump_config(config)) == config


def test_the_version_digest_changes_with_versions_but_not_with_weights() -> None:
    a = parse_config(GOOD)
    b = parse_config(with_(weights={"v1": 50, "v2": 50}))
    c = parse_config(with_(versions=[{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2b.mnn"}]))
    assert a.version_set_digest() == b.version_set_digest()
    assert a.version_set_digest() != c.version_set_digest()
