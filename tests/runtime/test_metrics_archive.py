"""A dead worker's metric files are merged into archives: the sums never change, never go back
while a merge runs, and the multiprocess directory (and the time a scrape takes) stays bounded
however many workers were replaced."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mnn_runtime.workers_metrics import collect, mark_dead
from tests.runtime.test_metrics import value
from tests.runtime.test_workers import BODY, children, server  # noqa: F401 - server is the fixture
from tests.runtime_server import RuntimeServer

# what a worker of pid P leaves: file kind -> (metric, sample name, labels, value, timestamp)
REQUESTS = ("mnn_inference_requests", "mnn_inference_requests_total", ["model", "version", "outcome"],
            ["scorer", "v2", "success"])
BUCKET = ("mnn_inference_duration_seconds", "mnn_inference_duration_seconds_bucket", ["model", "version", "le"],
          ["scorer", "v2", "0.01"])
FEEDBACK_SUM = ("mnn_feedback_value_sum", "mnn_feedback_value_sum", ["model", "version"], ["scorer", "v2"])
START = ("mnn_runtime_start_time_seconds", "mnn_runtime_start_time_seconds", ["model"], ["scorer"])
WEIGHT = ("mnn_version_traffic_weight_ratio", "mnn_version_traffic_weight_ratio", ["model", "version"],
          ["scorer", "v2"])
KINDS = {"counter": REQUESTS, "histogram": BUCKET, "gauge_sum": FEEDBACK_SUM, "gauge_max": START,
         "gauge_mostrecent": WEIGHT}


def leave(directory: Path, pid: int, values: dict[str, tuple[float, float]]) -> None:
    """The files a worker of ``pid`` writes: for each kind, (value, timestamp). Each is written aside
    and renamed into place: only the merge races with the scrapes here."""
    aside = directory / "aside"
    aside.mkdir(exist_ok=True)
    for kind, (value_, stamp) in values.items():
        metric, name, labels, labelvalues = KINDS[kind]
        d = MmapedDict(str(aside / f"{kind}_{pid}.db"))
        d.write_value(mmap_key(metric, name, labels, labelvalues, "help"), value_, stamp)
        d.close()
        os.replace(aside / f"{kind}_{pid}.db", directory / f"{kind}_{pid}.db")


def samples(directory: Path) -> dict[str, float]:
    text = generate_latest(collect(directory)).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in {k[1] for k in KINDS.values()}}


def test_dead_workers_are_merged_into_archives_and_every_sum_stays(tmp_path: Path) -> None:
    leave(tmp_path, 101, {"counter": (5, 0), "histogram": (3, 0), "gauge_sum": (2.5, 0), "gauge_max": (1000, 0),
                          "gauge_mostrecent": (0.2, 10)})
    leave(tmp_path, 102, {"counter": (7, 0), "histogram": (4, 0), "gauge_sum": (1.5, 0), "gauge_max": (900, 0),
                          "gauge_mostrecent": (0.6, 20)})
    leave(tmp_path, 103, {"counter": (1, 0), "gauge_mostrecent": (0.4, 15)})  # the live worker
    before = samples(tmp_path)
    assert before == {"mnn_inference_requests_total": 13, "mnn_inference_duration_seconds_bucket": 7,
                      "mnn_feedback_value_sum": 4, "mnn_runtime_start_time_seconds": 1000,
                      "mnn_version_traffic_weight_ratio": 0.6}
    mark_dead(101, tmp_path)
    mark_dead(102, tmp_path)
    assert samples(tmp_path) == before
    files = sorted(p.name for p in tmp_path.glob("*.db"))
    assert files == sorted([f"{k}_archive.db" for k in KINDS] + ["counter_103.db", "gauge_mostrecent_103.db"])
    leave(tmp_path, 104, {"counter": (2, 0), "gauge_max": (1100, 0), "gauge_mostrecent": (0.9, 5)})
    mark_dead(104, tmp_path)  # merged into the archives already there: older value, newer max
    after = samples(tmp_path)
    assert after["mnn_inference_requests_total"] == 15 and after["mnn_runtime_start_time_seconds"] == 1100
    assert after["mnn_version_traffic_weight_ratio"] == 0.6  # 0.9 was set before 0.6 was


def test_a_scrape_during_merges_never_sees_a_count_twice_or_missing(tmp_path: Path) -> None:
    """Before the lock, a scrape that listed a dead worker's file before the merge removed it raised
    FileNotFoundError, and one that read the archive after the merge and the file before saw its
    counts twice (then back: a counter reset for Prometheus and the direct provider)."""
    leave(tmp_path, 1, {"counter": (1, 0)})
    done = threading.Event()
    seen: list[float] = []
    errors: list[BaseException] = []

    def scrape() -> None:
        while not done.is_set():
            try:
                seen.append(samples(tmp_path)["mnn_inference_requests_total"])
            except BaseException as exc:  # noqa: BLE001  (reported below)
                errors.append(exc)

    reader = threading.Thread(target=scrape)
    reader.start()
    try:
        for pid in range(2, 302):  # each worker counts 1 request, then dies
            leave(tmp_path, pid, {"counter": (1, 0)})
            mark_dead(pid - 1, tmp_path)
    finally:
        done.set()
        reader.join()
    assert not errors, errors[:3]
    assert len(seen) > 20, len(seen)  # the reader scraped throughout
    assert all(b >= a for a, b in zip(seen, seen[1:])), [s for s in seen if s > 301][:5]
    assert max(seen) <= 301 and samples(tmp_path)["mnn_inference_requests_total"] == 301


def metrics_dir(pid: int) -> Path:
    """The multiprocess directory a worker maps its files from."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/mnn-rollout-metrics-" in line and line.endswith(".db"):
            return Path(line.split()[-1]).parent
    raise AssertionError(f"worker {pid} maps no metrics file")


@pytest.mark.timeout(180)
def test_replaced_workers_leave_no_files_behind_and_the_pod_total_stays(server: RuntimeServer,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    assert server.proc is not None
    sent = 0
    with httpx.Client() as client:
        for _ in range(6):
            workers = children(server.proc.pid)
            for _ in range(4):  # new connections: dealt to both workers
                assert client.post(server.url + "/v2/models/scorer/versions/v2/infer", json=BODY,
                                   headers={"Connection": "close"}).status_code == 200
                sent += 1
            directory = metrics_dir(workers[0])
            os.kill(workers[0], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not (len(now := children(server.proc.pid)) == 2 and workers[0] not in now):
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.05)
        total = value(client.get(server.url + "/metrics").text, "mnn_inference_requests_total", model="scorer",
                      version="v2", outcome="success")
    assert total == sent
    per_pid = {p.name.rsplit("_", 1)[1] for p in directory.glob("*.db")} - {"archive.db"}
    # the supervisor, the two live workers and at most one just replaced, not one per replacement (6)
    assert len(per_pid) <= 4, sorted(per_pid)
