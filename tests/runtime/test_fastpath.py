"""The ASGI fast path and the FastAPI route it stands in front of answer infer requests alike."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import orjson

from mnn_runtime.rest import create_app
from mnn_runtime.feedback import version_in
from mnn_runtime.server import build_runtime

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


def test_fast_path_and_fastapi_route_give_the_same_answers(examples_dir: Path) -> None:
    runtime = build_runtime(examples_dir / "runtime.yaml")
    plain = create_app(runtime.dataplane, runtime.metrics)

    async def ask(app: object) -> list[tuple[int, str | None, bytes]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            out = []
            for body in (BODY, {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 65],
                                             "data": [0.5] * 65}]}):
                r = await c.post("/v2/models/scorer/versions/v1/infer", json=body, headers={"X-User-Id": "a"})
                answer = r.json()
                if r.status_code == 200:  # a made id: random, naming the version
                    assert version_in(answer.pop("id")) == "v1"
                out.append((r.status_code, r.headers.get("x-model-version"), orjson.dumps(answer)))
            r = await c.post("/v2/models/scorer/infer", content=b" " * (17 * 1024 * 1024))
            out.append((r.status_code, None, r.content))
            return out

    try:
        fast, slow = asyncio.run(ask(runtime.app)), asyncio.run(ask(plain))
    finally:
        runtime.close()
    assert fast == slow
    assert [s for s, _, _ in fast] == [200, 400, 413]
