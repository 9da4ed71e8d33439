"""The dashboard in a real headless Chromium: `streamlit run dashboard/app.py` over the known store,
opened with Playwright; the runs and a chart image must render. Saves a screenshot to the test's
tmp dir and to reports/dashboard.png (git-ignored)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_healthy
from test_analysis_fixtures import closed_port, known_uri  # noqa: F401
from test_analysis_sweeps import optuna_url  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture
def server(known_uri, optuna_url, tmp_path):
    """`streamlit run dashboard/app.py` on 127.0.0.1:<free port>; stopped by its pid."""
    port = closed_port()
    env = os.environ | {"MLFLOW_TRACKING_URI": known_uri, "OPTUNA_STORAGE": optuna_url,
                        "STPPO_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "streamlit.log"
    cmd = [sys.executable, "-m", "streamlit", "run", "dashboard/app.py", "--server.address", "127.0.0.1",
           "--server.port", str(port), "--server.headless", "true", "--server.fileWatcherType", "none",
           "--browser.gatherUsageStats", "false"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/_stcore/health", proc, 60, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.mark.browser
@pytest.mark.timeout(180)
def test_dashboard_renders_runs_and_charts_in_chromium(server, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (scripts/install_browser.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(server, wait_until="domcontentloaded")
            page.get_by_text("7 runs", exact=False).first.wait_for(timeout=90_000)
            main = page.locator('[data-testid="stMain"]')
            chart = main.locator('[data-testid="stImage"] img').first
            chart.wait_for(state="visible", timeout=90_000)
            page.wait_for_function(
                "() => [...document.querySelectorAll('[data-testid=\"stMain\"] img')]"
                ".some(i => i.complete && i.naturalWidth > 200)", timeout=60_000)
            text = main.inner_text()
            assert "ppo: 3 runs, 2 collapsed" in text and "st_ppo: 3 runs, 0 collapsed" in text
            assert "grpo: 1 run, 1 collapsed" in text and "2/3" in text  # the per-preset HTML table
            assert "Traceback" not in text and not main.locator('[data-testid="stException"]').count()
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            (ROOT / "reports").mkdir(exist_ok=True)
            shutil.copy(shot, ROOT / "reports" / "dashboard.png")
            assert shot.stat().st_size > 20_000

            page.goto(f"{server}/collapse", wait_until="domcontentloaded")
            page.get_by_text("Collapsed at step 5 of 10.").wait_for(timeout=90_000)
            main.locator('[data-testid="stImage"] img').first.wait_for(state="visible", timeout=90_000)
        finally:
            browser.close()
