"""The direct provider across pods it has no baseline for: a pod missed by the first scrape of a
rollout, a pod that leaves the pod list and comes back, a pod that starts during the rollout.
Real runtime servers, as in test_direct_provider."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator

import httpx

from rollout_operator.providers.direct import DirectProvider
from testbed.promstack import send
from tests.operator.test_direct_provider import counts, ctx, pods  # noqa: F401 - pods is the fixture
from tests.runtime_server import RuntimeServer


def blipping(blip: set[str]) -> DirectProvider:
    """A provider whose scrape of the urls in ``blip`` times out."""
    def fetch(url: str) -> str:
        if url in blip:
            raise httpx.ConnectTimeout("network blip")
        return httpx.get(url + "/metrics", timeout=2).text

    return DirectProvider(fetch=fetch)


def test_a_pod_missed_by_the_first_scrape_is_not_counted_with_its_history(pods: list[RuntimeServer]) -> None:
    urls = [p.url for p in pods]
    send(urls[0], "v2", good=20, bad=5)  # before the rollout: must never count in its analysis
    blip = {urls[0]}
    provider = blipping(blip)
    assert provider.sample(ctx(*urls))["v2"].error is not None  # the baseline, without pods[0]
    blip.clear()
    send(urls[0], "v2", good=2)
    send(urls[1], "v2", good=1)
    sample = provider.sample(ctx(*urls))["v2"]
    # pods[0]'s counts go back to before the rollout: what it served in this interval is unknown
    assert sample.error is not None and urls[0] in sample.error and sample.requests is None, counts(
        {"v2": sample}, "v2")
    send(urls[0], "v2", good=3, bad=1)
    assert counts(provider.sample(ctx(*urls)), "v2") == (4, 1)


def test_a_pod_that_leaves_the_pod_list_and_comes_back_is_not_counted_with_its_history(
        pods: list[RuntimeServer]) -> None:
    urls = [p.url for p in pods]
    send(urls[0], "v2", good=20, bad=5)  # before the rollout
    provider = DirectProvider()
    provider.sample(ctx(*urls))
    send(urls[0], "v2", bad=4)
    send(urls[1], "v2", good=1)
    assert counts(provider.sample(ctx(urls[1])), "v2") == (1, 0)  # pods[0] not listed (its phase flapped)
    send(urls[0], "v2", good=2)
    # back without a baseline: its counters hold what the rollout already counted and what came before
    sample = provider.sample(ctx(*urls))["v2"]
    assert sample.error is not None and urls[0] in sample.error and sample.requests is None, counts(
        {"v2": sample}, "v2")
    send(urls[0], "v2", good=3, bad=1)
    assert counts(provider.sample(ctx(*urls)), "v2") == (4, 1)


def test_a_pod_started_during_the_rollout_is_counted_from_its_start(pods: list[RuntimeServer]) -> None:
    urls = [p.url for p in pods]
    provider = DirectProvider()
    provider.sample(ctx(urls[0]))  # pods[1] is not running yet
    pods[1].stop()
    pods[1].start()  # a pod that started after the rollout's baseline: all it counted is new
    send(urls[1], "v2", good=3, bad=2)
    send(urls[0], "v2", good=1)
    assert counts(provider.sample(ctx(*urls)), "v2") == (6, 2)


@contextlib.contextmanager
def answering(status: int, body: bytes) -> Iterator[str]:
    """A loopback HTTP server answering every GET with ``status`` and ``body``: its base url."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_scrape_without_the_runtime_start_time_is_no_data_and_keeps_the_baseline(
        pods: list[RuntimeServer]) -> None:
    """Found in review: an answer parsed to no series (an empty page, an error status with an empty
    body) became the pod's baseline, and the next scrape counted everything the pod ever served
    (before the rollout too) as that one interval's: (29, 6) where the interval had (4, 1)."""
    urls = [p.url for p in pods]
    send(urls[0], "v2", good=20, bad=5)  # before the rollout
    empty: set[str] = set()

    def fetch(url: str) -> str:
        return "" if url in empty else httpx.get(url + "/metrics", timeout=2).text

    provider = DirectProvider(fetch=fetch)
    provider.sample(ctx(*urls))  # the baseline, with both pods
    empty.add(urls[0])
    sample = provider.sample(ctx(*urls))["v2"]
    assert sample.error is not None and urls[0] in sample.error and "mnn_runtime_start_time_seconds" in sample.error
    empty.clear()
    send(urls[0], "v2", good=2, bad=1)
    send(urls[1], "v2", good=1)
    assert counts(provider.sample(ctx(*urls)), "v2") == (4, 1)


def test_an_error_status_is_no_data_whatever_its_body() -> None:
    with answering(503, b"") as url:
        provider = DirectProvider()
        provider.sample(ctx(url))  # the baseline
        sample = provider.sample(ctx(url))["v2"]
    assert sample.error is not None and "503" in sample.error, sample
