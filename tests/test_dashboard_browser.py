"""The dashboard in a real headless Chromium: `streamlit run dashboard/app.py` over the known store,
opened with Playwright; the runs and an interactive chart must render. Then over the workbench store:
the Samples page with a marked search call and an observation, the Early warning page with its
table. Then over a store of stale-rollout runs: the Stability frontier page along the lag, and the
Collapse diagnosis page with the mismatch panels and the per-turn mismatch heatmap. Saves screenshots to the test's tmp dir and to reports/ (git-ignored)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers import start_on_free_port
from helpers.stores import known_uri, stale_uri, workbench_uri  # noqa: F401
from test_analysis_sweeps import optuna_url  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@contextlib.contextmanager
def streamlit_server(uri: str, optuna_url: str, tmp_path: Path):
    """`streamlit run dashboard/app.py` on 127.0.0.1:<free port>; stopped by its pid."""
    env = os.environ | {"MLFLOW_TRACKING_URI": uri, "OPTUNA_STORAGE": optuna_url,
                        "STPPO_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "streamlit", "run", "dashboard/app.py", "--server.address", "127.0.0.1",
           "--server.headless", "true", "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false"]
    proc, url = start_on_free_port(lambda port: [*cmd, "--server.port", str(port)], "/_stcore/health", 120,
                                   tmp_path / "streamlit.log", cwd=ROOT, env=env)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture
def server(known_uri, optuna_url, tmp_path):
    with streamlit_server(known_uri, optuna_url, tmp_path) as url:
        yield url


@pytest.fixture
def workbench_server(workbench_uri, optuna_url, tmp_path):
    with streamlit_server(workbench_uri, optuna_url, tmp_path) as url:
        yield url


@pytest.fixture
def stale_server(stale_uri, optuna_url, tmp_path):
    with streamlit_server(stale_uri, optuna_url, tmp_path) as url:
        yield url


@contextlib.contextmanager
def chromium_page():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (scripts/install_browser.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1500, "height": 1100})
        finally:
            browser.close()


def _screenshot(page, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    (ROOT / "reports").mkdir(exist_ok=True)
    shutil.copy(shot, ROOT / "reports" / name)
    return shot


def _no_error(main) -> str:
    text = main.inner_text()
    assert "Traceback" not in text and not main.locator('[data-testid="stException"]').count()
    return text


@pytest.mark.browser
@pytest.mark.timeout(900)  # a hang guard over all its waits (each names what it waits for)
def test_dashboard_renders_runs_and_charts_in_chromium(server, tmp_path):
    with chromium_page() as page:
        page.goto(server, wait_until="domcontentloaded")
        page.get_by_text("7 runs", exact=False).first.wait_for(timeout=90_000)
        main = page.locator('[data-testid="stMain"]')
        # an Altair chart drawn by Vega into a canvas or SVG with real size
        page.wait_for_function(
            "() => [...document.querySelectorAll('[data-testid=\"stMain\"] .vega-embed canvas, "
            "[data-testid=\"stMain\"] .vega-embed svg')].some(e => e.getBoundingClientRect().width > 200)",
            timeout=90_000)
        text = _no_error(main)
        assert "ppo: 3 runs, 2 collapsed" in text and "st_ppo: 3 runs, 0 collapsed" in text
        assert "grpo: 1 run, 1 collapsed" in text and "2/3" in text  # the per-preset HTML table
        assert _screenshot(page, tmp_path, "dashboard.png").stat().st_size > 20_000

        page.goto(f"{server}/collapse", wait_until="domcontentloaded")
        page.get_by_text("Collapsed at step 5 of 10.").wait_for(timeout=90_000)
        main.locator(".vega-embed").first.wait_for(state="visible", timeout=90_000)


@pytest.mark.browser
@pytest.mark.timeout(900)  # a hang guard over all its waits (each names what it waits for)
def test_samples_and_early_warning_pages_in_chromium(workbench_server, tmp_path):
    with chromium_page() as page:
        main = page.locator('[data-testid="stMain"]')
        page.goto(f"{workbench_server}/samples", wait_until="domcontentloaded")
        page.get_by_text("Saved at steps 10, 20, 26, 30, 40", exact=False).wait_for(timeout=90_000)
        search = main.get_by_text("tool call: search").first
        search.wait_for(state="visible", timeout=60_000)
        assert search.bounding_box()["width"] > 20  # the marked search call is drawn
        main.get_by_text("observation", exact=True).first.wait_for(state="visible", timeout=30_000)
        text = _no_error(main)
        assert "collapse onset at step 22" in text and text.count("tool call: search") == 3
        assert "<search>" in text  # the agent's own text, shown (escaped) next to its badge
        _screenshot(page, tmp_path, "dashboard_samples.png")

        page.goto(f"{workbench_server}/warning", wait_until="domcontentloaded")
        page.get_by_text("2 collapsed runs", exact=False).wait_for(timeout=90_000)
        main.locator('[data-testid="stTable"]').first.wait_for(state="visible", timeout=60_000)
        main.locator('[data-testid="stImage"] img').first.wait_for(state="visible", timeout=60_000)
        table = main.locator('[data-testid="stTable"]').first.inner_text()
        assert "warned k/n" in table and "clip_frac" in table and "zero_signal_groups" in table and "2/2" in table
        text = _no_error(main)
        assert "2 runs without collapse" in text and "robust z-score" in text
        _screenshot(page, tmp_path, "dashboard_warning.png")


def _charts_drawn(page, n: int) -> None:
    """Wait until at least n Altair charts of the main area are drawn with real size."""
    page.wait_for_function(
        "n => [...document.querySelectorAll('[data-testid=\"stMain\"] .vega-embed')].filter(e => "
        "[...e.querySelectorAll('canvas, svg')].some(c => c.getBoundingClientRect().width > 200)).length >= n",
        arg=n, timeout=90_000)


@pytest.mark.browser
@pytest.mark.timeout(900)  # a hang guard over all its waits (each names what it waits for)
def test_frontier_and_mismatch_panels_in_chromium(stale_server, tmp_path):
    with chromium_page() as page:
        main = page.locator('[data-testid="stMain"]')
        page.goto(f"{stale_server}/frontier", wait_until="domcontentloaded")
        page.get_by_text("22 runs in 11 cells: lags 0, 1, 2, 4", exact=False).wait_for(timeout=90_000)
        _charts_drawn(page, 1)
        table = main.locator('[data-testid="stTable"]').first.inner_text()
        assert "grpo+decoupled_geo_rs" in table and "lag mode" in table and "uniform" in table
        text = _no_error(main)
        assert "Wilson 95% interval" in text
        _screenshot(page, tmp_path, "dashboard_frontier_lag.png")

        page.goto(f"{stale_server}/collapse", wait_until="domcontentloaded")
        page.get_by_text("rollouts lag 4 behind", exact=False).wait_for(timeout=90_000)
        main.get_by_text("Per-turn sampler vs trainer mismatch").wait_for(timeout=60_000)
        _charts_drawn(page, 2)  # Fig. 2 with the mismatch panels, and the per-turn mismatch heatmap
        text = _no_error(main)
        assert "Collapsed at step 12 of 30." in text and "turn/k*/rollout_kl" in text
        _screenshot(page, tmp_path, "dashboard_collapse_mismatch.png")
