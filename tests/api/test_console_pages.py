"""The console's server-rendered fragments escape everything a client could have chosen."""

from __future__ import annotations

import json
from html.parser import HTMLParser

from api.console import pages
from api.console.readings import PendingOp, PoolReading, TenantReadings
from twinkle.futures import FutureRecord
from twinkle.records import ModelRecord, SamplingSessionRecord, SessionRecord

EVIL = '<script>alert("x")</script>'


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append(tag)


def test_client_chosen_strings_never_become_markup() -> None:
    readings = TenantReadings(
        tenant="t1",
        sessions=[SessionRecord("s1", "t1", 0.0, 0.0, sdk_version=EVIL, finished=EVIL)],
        runs=[ModelRecord("s1:train:0", "t1", "s1", EVIL, "app", "q", unload_reason=EVIL)],
        sampling_sessions=[SamplingSessionRecord("s1:sample:0", "t1", "s1", EVIL, "q", model_path=EVIL)],
        ops=[PendingOp(FutureRecord("r1", "sample", "t1", "", "q", status="failed", error=EVIL), None)])
    checkpoints = {"s1:train:0": [{"checkpoint_id": "weights/a", "tinker_path": EVIL, "checkpoint_type": EVIL,
                                   "size_bytes": 2048, "time": "2026-12-03T00:00:00", "expires_at": None}]}
    admin = pages.admin_section([PoolReading("model.a.0", "a", "model", True, 2, 1, 3, 8)],
                                [{"t": 0, "queue": EVIL, "op": EVIL, "owner": EVIL, "error": EVIL}])
    html = pages.overview(readings, checkpoints, lambda run, c: f'/dl?x="{EVIL}', admin=admin)
    parser = Tags()
    parser.feed(html)
    assert "script" not in parser.tags
    assert "&lt;script&gt;" in html and "2.0 KB" in html


def test_a_run_page_carries_its_series_as_json_for_the_chart_script() -> None:
    run = ModelRecord("s1:train:0", "t1", "s1", "tiny", "app", "q", steps=2)
    html = pages.run_page(run, {"loss:sum": [(1, 3.0), (2, 2.0)], "grad_norm:mean": [(1, 1.0), (2, 0.5)]}, [],
                          lambda run, c: None)
    start = html.index('data-chart="') + len('data-chart="')
    from html import unescape

    data = json.loads(unescape(html[start : html.index('"', start)]))
    assert data == {"series": {"loss:sum": [[1, 3.0], [2, 2.0]], "grad_norm:mean": [[1, 1.0], [2, 0.5]]},
                    "default": "loss:sum"}
    assert "<script" not in html


def test_a_checkpoints_merged_export_shows_its_largest_difference_and_a_download_only_once_verified() -> None:
    run = ModelRecord("s1:train:0", "t1", "s1", "tiny", "app", "q")
    check = {"status": "verified", "max_abs_diff": 3.3e-06, "tolerance": 0.001,
             "adapter": {"status": "verified", "max_abs_diff": 9.5e-07},
             "merged": {"status": "verified", "max_abs_diff": 3.3e-06, "size_bytes": 600_000}}
    entries = [{"checkpoint_id": "weights/a", "tinker_path": "tinker://s1:train:0/weights/a", "export": check},
               {"checkpoint_id": "weights/b", "tinker_path": "tinker://s1:train:0/weights/b",
                "export": {**check, "status": "failed", "max_abs_diff": 0.31, "merged": {"status": EVIL}}},
               {"checkpoint_id": "weights/c", "tinker_path": "tinker://s1:train:0/weights/c"},
               {"checkpoint_id": "external_weights/d", "tinker_path": "tinker://s1:train:0/external_weights/d",
                "export": {"status": "verified", "max_abs_diff": 1e-6, "adapter": check["adapter"]}}]
    html = pages.run_page(run, {}, entries, lambda run, c: None,
                          lambda run, c: f"/merged/{c['checkpoint_id']}" if c.get("export") else None)
    rows = html.split("<tr>")[2:]
    assert "merged export" in html.split("<tr>")[1]
    assert "badge-verified" in rows[0] and "max |Δ| 3.3e-06" in rows[0] and 'href="/merged/weights/a"' in rows[0]
    assert "(585.9 KB)" in rows[0]  # the merged model's size next to its link
    assert "badge-failed" in rows[1] and "max |Δ| 0.31" in rows[1] and "/merged/weights/b" not in rows[1]
    assert "&lt;script&gt;" in rows[1] and "<script" not in html
    assert rows[2].split("</tr>")[0].endswith("<td>—</td><td>—</td>")  # no export yet
    assert "adapter max |Δ| 1e-06" in rows[3] and "/merged/" not in rows[3]  # a checked adapter, not merged
