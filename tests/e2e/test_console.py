"""The web console in a real headless Chromium (Debian's, driven by Playwright): sign in with a key, a run that
trained 5 steps shows a falling loss curve, another tenant's run id shows nothing, operators see the pools, and
the usage page charts what a key's ops used per day and lists it per run. Screenshots are saved under
tests/artifacts/ (docs/console-*.png are copies of them)."""

from __future__ import annotations

import csv
import io
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import tinker
from tinker import types

from tests.harness import LaunchedServer, launch
from twinkle.auth import hash_key, tenant_id
from twinkle.futures import FutureRecord, new_request_id
from twinkle.usage import UsageLedger, day_of, sum_amounts

pytestmark = pytest.mark.e2e
OWNER, STRANGER, OPERATOR = "tml-console-owner", "tml-console-stranger", "tml-console-operator"
PAYER = "tml-console-payer"  # its usage is recorded by the test itself, as the pools record it
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    auth = {"api_keys": [hash_key(OWNER), hash_key(STRANGER), hash_key(PAYER)], "admin_keys": [hash_key(OPERATOR)]}
    launched = launch(tmp_path_factory.mktemp("console"), tiny_model_dir, db=15, sampler=True, auth=auth,
                      queue_config={"rps_limit": 100})
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def trained_run(server: LaunchedServer) -> str:
    """OWNER's run: 5 optimizer steps on one batch (the loss falls), a checkpoint and a sampler."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key=OWNER)
    training = service.create_lora_training_client(base_model="tiny-qwen", rank=8).result()
    batch = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                         loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)})
             for t in ([5 + (i * 3 + k) % 40 for i in range(16)] for k in range(4))]
    for _ in range(5):
        training.forward_backward(batch, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    training.save_state("step-5").result()
    service.create_sampling_client(model_path=training.save_weights_for_sampler("sampler-5").result().path)
    return str(training.model_id)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # Fail, never skip: `make test` installs Debian's chromium (the Makefile's `browser` target).
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: run `make browser` (apt-get install chromium)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


def sign_in(browser: Any, server: LaunchedServer, key: str, hash_path: str = "#/") -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server.base_url + "/console" + hash_path)
    page.fill("#api-key", key)
    page.click("#sign-in button[type=submit]")
    page.wait_for_selector("body[data-loaded]")
    return page


def test_the_owner_sees_a_falling_loss_curve_of_a_run_that_trained_five_steps(
        server: LaunchedServer, trained_run: str, browser: Any) -> None:
    page = sign_in(browser, server, OWNER)
    assert page.locator(f"#runs a[data-run='{trained_run}']").count() == 1
    assert page.locator("#checkpoints a[download]").count() >= 1  # a signed download link per checkpoint
    assert "sampler_weights/sampler-5" in page.inner_text("#samplers")
    assert page.locator("#pools").count() == 0  # tenants do not see the operators' view
    assert "models-tiny" in page.inner_text("#rates")
    assert page.locator("#ops tbody tr").count() >= 11  # create, 5 x (forward_backward, optim_step), saves
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console-overview.png"), full_page=True)

    page.click(f"#runs a[data-run='{trained_run}']")
    page.wait_for_selector("figure.chart svg[data-points='5']")
    assert page.get_attribute("figure.chart svg", "data-metric") == "loss:sum"
    titles = page.locator("figure.chart svg circle title").evaluate_all("ts => ts.map(t => t.textContent)")
    losses = [float(t.split(": ")[1]) for t in titles]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    heights = [float(c) for c in page.locator("figure.chart svg circle").evaluate_all(
        "cs => cs.map(c => c.getAttribute('cy'))")]
    assert heights[-1] > heights[0]  # drawn falling: SVG y grows downwards
    page.screenshot(path=str(ARTIFACTS / "console-run.png"), full_page=True)
    page.close()


def test_the_key_stays_in_the_tab_session_and_never_becomes_a_cookie(browser: Any, server: LaunchedServer) -> None:
    page = sign_in(browser, server, OWNER)
    assert page.evaluate("sessionStorage.getItem('twinkle.apiKey')") == OWNER
    assert page.context.cookies() == []
    assert page.evaluate("localStorage.length") == 0
    page.click("#sign-out")
    assert page.evaluate("sessionStorage.getItem('twinkle.apiKey')") is None
    assert page.is_visible("#sign-in")
    page.close()


def test_another_tenants_run_id_shows_nothing(browser: Any, server: LaunchedServer, trained_run: str) -> None:
    page = sign_in(browser, server, STRANGER, "#/runs/" + quote(trained_run, safe=""))
    assert page.locator("figure.chart").count() == 0
    assert "not found" in page.inner_text("#view").lower()
    assert page.locator("#view table, #view section").count() == 0  # only the message naming the id asked for
    page.goto(server.base_url + "/console#/")
    page.wait_for_selector("#runs")
    assert page.locator("#runs a[data-run]").count() == 0
    page.close()
    response = httpx.get(f"{server.base_url}/console/api/runs/{quote(trained_run, safe='')}/metrics",
                         headers={"X-API-Key": STRANGER})
    assert response.status_code == 404


def test_an_unknown_key_is_refused_at_sign_in(browser: Any, server: LaunchedServer) -> None:
    page = browser.new_page()
    page.goto(server.base_url + "/console")
    page.fill("#api-key", "tml-not-a-key")
    page.click("#sign-in button[type=submit]")
    page.wait_for_selector("#sign-in-error:has-text('not accepted')")
    assert page.evaluate("sessionStorage.getItem('twinkle.apiKey')") is None
    page.close()


def test_an_operator_sees_every_pool(browser: Any, server: LaunchedServer, trained_run: str) -> None:
    page = sign_in(browser, server, OPERATOR)
    pools = page.inner_text("#pools")
    assert "model.models-tiny.0" in pools and "sampler.sampler-tiny" in pools
    assert page.locator("#errors").count() == 1
    assert page.locator(f"#runs a[data-run='{trained_run}']").count() == 0  # still only its own resources
    page.screenshot(path=str(ARTIFACTS / "console-operator.png"), full_page=True)
    page.close()


def test_the_metrics_json_has_one_point_per_step(server: LaunchedServer, trained_run: str) -> None:
    body = httpx.get(f"{server.base_url}/console/api/runs/{quote(trained_run, safe='')}/metrics",
                     headers={"X-API-Key": OWNER}).json()
    assert body["steps"] == 5
    assert [s for s, _ in body["series"]["loss:sum"]] == [1, 2, 3, 4, 5]
    assert "grad_norm:mean" in body["series"]
    assert json.dumps(body)  # plain JSON, no NaN


NOW = time.time()
PAYER_OPS = [  # (days ago, run, what the op used)
    (0, "s7:train:0", {"trained_tokens": 12_000, "optim_steps": 3, "pool_ms": 5_400}),
    (0, "s7:train:1", {"trained_tokens": 3_000, "pool_ms": 1_200, "checkpoint_bytes": 2_500_000}),
    (1, "s7:train:0", {"trained_tokens": 8_000, "optim_steps": 2, "pool_ms": 3_600}),
    (3, "s7:train:0", {"trained_tokens": 4_000, "optim_steps": 1, "pool_ms": 2_000}),
    (6, "s7:train:1", {"sampled_prompt_tokens": 300, "sampled_tokens": 900, "pool_ms": 800}),
]


@pytest.fixture(scope="module")
def payer_usage(server: LaunchedServer) -> dict[str, int]:
    """PAYER's ops over the last week, recorded once each the way the pools record them."""
    r = server.redis
    ledger = UsageLedger(r, server.keys)
    for days_ago, run, amounts in PAYER_OPS:
        rec = FutureRecord(request_id=new_request_id(), op="forward_backward", owner=tenant_id(PAYER), model_id=run,
                           queue="model.models-tiny.0", status="completed")
        r.hset(server.keys.future(rec.request_id), mapping=rec.to_hash())
        assert ledger.record(rec, "tiny-qwen", amounts, at=NOW - days_ago * 86400)
    return sum_amounts(amounts for _, _, amounts in PAYER_OPS)


def test_the_usage_page_charts_a_keys_usage_per_day_and_lists_it_per_run(
        server: LaunchedServer, browser: Any, payer_usage: dict[str, int]) -> None:
    page = sign_in(browser, server, PAYER)
    page.click("nav a[href='#/usage']")
    page.wait_for_selector("body[data-loaded^='/console/fragments/usage'] .usage-chart")
    assert tenant_id(PAYER) in page.inner_text("h2.usage-title")
    totals = page.inner_text("#usage-totals")
    assert "27,000" in totals and "13 s" in totals and "2.4 MB" in totals and "900" in totals
    bars = page.locator(".usage-chart[data-metric='trained_tokens'] rect.bar")
    titles = bars.evaluate_all("bs => bs.map(b => b.querySelector('title').textContent)")
    assert titles == [f"{day_of(NOW - 3 * 86400)}: 4,000", f"{day_of(NOW - 86400)}: 8,000", f"{day_of(NOW)}: 15,000"]
    heights = [float(h) for h in bars.evaluate_all("bs => bs.map(b => b.getAttribute('height'))")]
    assert heights[0] < heights[1] < heights[2]  # drawn to scale: today's 15,000 is the tallest bar
    assert page.locator(".usage-chart[data-metric='sampled_tokens'] rect.bar").count() == 1
    assert page.locator(".usage-chart svg").count() == 6  # one chart per quantity with usage: no forwarded_tokens
    runs = {row[0]: row for row in page.locator("#usage-runs tbody tr").evaluate_all(
        "rs => rs.map(r => [...r.cells].map(c => c.textContent))")}
    assert set(runs) == {"s7:train:0", "s7:train:1"}
    assert runs["s7:train:0"][1] == "24,000" and runs["s7:train:1"][1] == "3,000"
    assert page.locator("#usage-days tbody tr").count() == 4
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console-usage.png"), full_page=True)

    with page.expect_download() as download:  # the key goes as a header, never in the URL
        page.click("a[data-csv*='-day-']")
    assert download.value.suggested_filename.startswith(f"usage-{tenant_id(PAYER)}-day-")
    lines = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    assert [(line["day"], line["trained_tokens"]) for line in lines] == [
        (day_of(NOW - 6 * 86400), "0"), (day_of(NOW - 3 * 86400), "4000"), (day_of(NOW - 86400), "8000"),
        (day_of(NOW), "15000")]
    page.close()


def test_an_operator_picks_a_tenant_on_the_usage_page_and_others_cannot(
        server: LaunchedServer, browser: Any, payer_usage: dict[str, int]) -> None:
    page = sign_in(browser, server, OPERATOR, "#/usage")
    page.select_option("select.usage-tenant", tenant_id(PAYER))
    page.wait_for_selector(f"h2.usage-title:has-text('{tenant_id(PAYER)}')")
    assert "27,000" in page.inner_text("#usage-totals")
    page.select_option("select.usage-tenant", "all")
    page.wait_for_selector("h2.usage-title:has-text('all tenants')")
    assert tenant_id(PAYER) in page.inner_text("#usage-runs")
    page.screenshot(path=str(ARTIFACTS / "console-usage-all.png"), full_page=True)
    page.close()
    page = sign_in(browser, server, STRANGER, "#/usage?key=" + tenant_id(PAYER))
    assert "operator key" in page.inner_text("#view")
    assert page.locator(".usage-chart").count() == 0
    page.close()
