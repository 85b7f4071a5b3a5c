"""Outcomes per version: every response has an id; feedback on it is counted for the version that
answered (issue 14 item 2)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import orjson
import pytest

from mnn_runtime.feedback import EXPIRED, MAX_ID_LENGTH, UNKNOWN, FeedbackBook, new_id, parse_feedback, version_in
from mnn_runtime.errors import BadRequest
from mnn_runtime.server import build_runtime
from tests.runtime.test_metrics import value
from tests.runtime_server import FEEDBACK_TOKEN, RuntimeServer

pytestmark = pytest.mark.timeout(120)
BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


def infer(url: str, user: str, request_id: str | None = None) -> tuple[str, str]:
    body = dict(BODY, **({"id": request_id} if request_id else {}))
    with httpx.Client() as c:  # a connection of its own: with workers, any worker may answer
        r = c.post(url + "/v2/models/scorer/infer", json=body, headers={"X-User-Id": user})
    assert r.status_code == 200, r.text
    return r.json()["id"], r.headers["X-Model-Version"]


def feedback(url: str, items: object, token: str | None = FEEDBACK_TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client() as c:
        return c.post(url + "/v2/models/scorer/feedback", json=items, headers=headers)


def counted(url: str, version: str) -> tuple[float, float, float]:
    text = httpx.get(url + "/metrics").text
    return tuple(value(text, name, model="scorer", version=version)  # type: ignore[return-value]
                 for name in ("mnn_feedback_total", "mnn_feedback_value_sum", "mnn_feedback_value_squared_sum"))


def test_made_ids_name_their_version_and_others_do_not() -> None:
    made = new_id("v2-int8")
    assert version_in(made) == "v2-int8" and version_in(new_id("v1")) == "v1"
    for other in ("order-17", "abc.v1", "0123456789abcdeg.v1", "0123456789abcdef.", "v1"):
        assert version_in(other) is None, other


def test_the_book_forgets_the_oldest_and_the_expired() -> None:
    now = [0.0]
    book = FeedbackBook(max_entries=2, ttl=10, clock=lambda: now[0])
    book.remember("a", "v1")
    book.remember("b", "v2")
    book.remember("c", "v2")
    assert book.version("a") == (None, UNKNOWN)  # pushed out by the bound
    assert book.version("b") == ("v2", None)
    now[0] = 11
    assert book.version("c") == (None, EXPIRED)


@pytest.mark.parametrize(("body", "message"), [
    (b"{oops", "feedback body is not JSON"),
    (b"[]", "feedback: 0 items"),
    (b'{"value": 1}', "feedback.id: None is not a response id"),
    (b'[{"id": "x", "value": -1}]', "feedback[0].value: -1 is not a number from 0 to 1e+15"),
    (b'{"id": "x", "value": true}', "feedback.value: True is not a number from 0 to 1e+15"),
    (b'{"id": "x", "value": "1"}', "feedback.value: '1' is not a number from 0 to 1e+15"),
    # its square would overflow the sum of squares (1e200 twice made it +Inf for good)
    (b'[{"id": "x", "value": 1}, {"id": "y", "value": 1e200}]', "feedback[1].value: 1e+200 is not a number from 0"),
    (b'{"id": "x", "value": 1000000000000001}', "feedback.value: 1000000000000001 is not a number from 0"),
])
def test_bad_feedback_is_refused_naming_the_field(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(message)):
        parse_feedback(body)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_feedback_is_counted_for_the_version_that_answered(model_dir: Path, tmp_path: Path, workers: int) -> None:
    server = RuntimeServer(model_dir / "runtime.yaml", tmp_path / "server.log", extra_args=["--workers", str(workers)])
    server.start()
    try:
        url = server.url
        answered = [infer(url, f"user-{i}") for i in range(40)]  # runtime.yaml: v1 90%, v2 10%
        by_version = {v: [rid for rid, ver in answered if ver == v] for v in ("v1", "v2")}
        assert by_version["v1"] and by_version["v2"], answered
        assert all(version_in(rid) == ver for rid, ver in answered)
        # each item on a connection of its own: made ids count wherever they land
        for rid, ver in answered:
            r = feedback(url, {"id": rid, "value": 2.0 if ver == "v2" else 1.0})
            assert r.status_code == 200 and r.json() == {"counted": 1, "unmatched": 0}, r.text
        n1, n2 = len(by_version["v1"]), len(by_version["v2"])
        assert counted(url, "v1") == (n1, n1 * 1.0, n1 * 1.0)
        assert counted(url, "v2") == (n2, n2 * 2.0, n2 * 4.0)
        # a list, with an unknown id among them: counted apart, not an error
        r = feedback(url, [{"id": by_version["v2"][0], "value": 0.5}, {"id": "no-such-request", "value": 1}])
        assert r.status_code == 200 and r.json() == {"counted": 1, "unmatched": 1}
        text = httpx.get(url + "/metrics").text
        assert value(text, "mnn_feedback_unmatched_total", model="scorer", reason="unknown") == 1
        # bad feedback: 400 naming the field, the counts unchanged
        r = feedback(url, {"id": by_version["v1"][0], "value": -3})
        assert r.status_code == 400 and "feedback.value: -3" in r.json()["error"]
        assert counted(url, "v1")[0] == n1
    finally:
        server.stop()


def test_a_requests_own_id_is_echoed_and_counted_where_it_was_answered(model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    server: RuntimeServer = start_server(model_dir / "runtime.yaml")
    rid, version = infer(server.url, "user-3", request_id="order-17")
    assert rid == "order-17"
    r = feedback(server.url, {"id": "order-17", "value": 1})
    assert r.json() == {"counted": 1, "unmatched": 0}
    assert counted(server.url, version)[0] == 1


def test_an_id_in_the_made_form_naming_another_version_is_replaced_by_one_naming_the_server(
        model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    server: RuntimeServer = start_server(model_dir / "runtime.yaml")
    with httpx.Client(base_url=server.url) as c:
        other = c.post("/v2/models/scorer/versions/v1/infer", json=dict(BODY, id="0123456789abcdef.v2")).json()
        same = c.post("/v2/models/scorer/versions/v1/infer", json=dict(BODY, id="0123456789abcdef.v1")).json()
    assert other["model_version"] == "v1" and other["id"] != "0123456789abcdef.v2"
    assert version_in(other["id"]) == "v1"  # feedback on it counts for the version that answered
    assert same["id"] == "0123456789abcdef.v1"
    assert feedback(server.url, {"id": other["id"], "value": 1}).json() == {"counted": 1, "unmatched": 0}
    assert counted(server.url, "v1")[0] == 1 and counted(server.url, "v2")[0] == 0


def test_an_own_id_longer_than_feedback_can_name_is_echoed_but_not_remembered(examples_dir: Path) -> None:
    runtime = build_runtime(examples_dir / "runtime.yaml")
    try:
        dataplane = runtime.dataplane
        for rid in ("r" * MAX_ID_LENGTH, "r" * (MAX_ID_LENGTH + 1)):
            result = asyncio.run(dataplane.infer("scorer", "v1", orjson.dumps(dict(BODY, id=rid)), {}))
            assert result.status == 200 and orjson.loads(result.body)["id"] == rid
        assert dataplane.feedback_book.version("r" * MAX_ID_LENGTH) == ("v1", None)
        assert dataplane.feedback_book.version("r" * (MAX_ID_LENGTH + 1)) == (None, UNKNOWN)
    finally:
        runtime.close()


def test_a_feedback_token_is_required_when_the_runtime_has_one(model_dir: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "feedback-token"
    token_file.write_text("s3cret-feedback\n")
    server = RuntimeServer(model_dir / "runtime.yaml", tmp_path / "server.log",
                           extra_args=["--feedback-token-file", str(token_file)])
    server.start()
    try:
        rid, _ = infer(server.url, "user-1")
        assert httpx.get(server.url + "/v2/models/scorer/status").json()["feedback"] is True
        for token in (None, "wrong"):
            r = feedback(server.url, {"id": rid, "value": 1}, token)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), r.text
        r = feedback(server.url, {"id": rid, "value": 1}, "s3cret-feedback")
        assert r.status_code == 200 and r.json()["counted"] == 1
    finally:
        server.stop()


def test_without_a_token_feedback_is_refused_saying_how_to_give_one(examples_dir: Path) -> None:
    """Feedback decides rollouts and experiments: a runtime with no token takes none at all."""
    runtime = build_runtime(examples_dir / "runtime.yaml")

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=runtime.app), base_url="http://t") as c:
            assert (await c.get("/v2/models/scorer/status")).json()["feedback"] is False  # the operator reads it
            rid = (await c.post("/v2/models/scorer/infer", json=BODY)).json()["id"]
            return await c.post("/v2/models/scorer/feedback", json={"id": rid, "value": 1},
                                headers={"Authorization": "Bearer anything"})

    try:
        r = asyncio.run(post())
        assert r.status_code == 403, r.text
        assert "--feedback-token-file" in r.json()["error"] and "spec.runtime.feedback.secretName" in r.json()["error"]
        assert value(runtime.metrics.exposition().decode(), "mnn_feedback_total", model="scorer", version="v1") == 0
    finally:
        runtime.close()


def test_the_token_may_come_from_the_environment_and_a_blank_one_stops_the_start(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mnn_rollout.local.process import LocalRuntime

    monkeypatch.setenv("MNN_ROLLOUT_FEEDBACK_TOKEN", " from-the-env\n")  # as a Secret's value may end
    server = LocalRuntime(model_dir / "runtime.yaml", tmp_path / "env.log")
    server.start()
    try:
        rid, _ = infer(server.url, "user-9")
        assert feedback(server.url, {"id": rid, "value": 1}, "from-the-env").json()["counted"] == 1
        assert feedback(server.url, {"id": rid, "value": 1}, FEEDBACK_TOKEN).status_code == 401
    finally:
        server.stop()
    monkeypatch.setenv("MNN_ROLLOUT_FEEDBACK_TOKEN", "  ")
    blank = LocalRuntime(model_dir / "runtime.yaml", tmp_path / "blank.log")
    with pytest.raises(RuntimeError, match="exited with 2"):
        blank.start()
    assert "MNN_ROLLOUT_FEEDBACK_TOKEN: must hold one token" in blank.log()


def test_made_ids_differ_across_calls_and_forked_workers() -> None:
    import os

    ids = {new_id("v1") for _ in range(1000)}
    assert len(ids) == 1000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker forked after ids were made: its own prefix
        os.write(write, new_id("v1").encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    assert child[:8] != new_id("v1")[:8] and version_in(child) == "v1"
