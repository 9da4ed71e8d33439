"""The verl plugin's registration: `import verl` alone registers every stppo_* loss (through the
`verl.plugins` entry point of pyproject.toml), and a broken plugin is a visible warning, not a
silent "Unsupported loss mode" later. Subprocesses: each starts from a plain `import verl`."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from stppo.algos import PRESETS

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = sorted(f"stppo_{p}" for p in PRESETS)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    full.pop("VERL_USE_EXTERNAL_MODULES", None)
    with tempfile.TemporaryDirectory() as empty:  # `-c` puts the cwd first on sys.path: nothing there
        return subprocess.run([sys.executable, "-c", code], cwd=empty, env=full, text=True,
                              capture_output=True, timeout=300)


LIST_STPPO = ("import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
              "print(sorted(k for k in R if k.startswith('stppo_')))")


def test_entry_point_is_declared_in_the_installed_metadata():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("stppo") == "stppo.integrations.verl.plugin", (
        "stppo's verl.plugins entry point is not installed: re-run `make verl-env` (or "
        "`.venv-verl/bin/pip install --no-deps -e .`) from this checkout")


def test_import_verl_alone_registers_every_preset_loss():
    out = run_python(LIST_STPPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(EXPECTED)
    # ... and it is the entry point that does it: with verl's plugin discovery off, nothing is.
    off = run_python(LIST_STPPO, VERL_USE_EXTERNAL_PLUGINS="none")
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == "[]"


def test_a_broken_plugin_is_a_visible_warning_not_a_silent_miss():
    code = ("import sys\nsys.modules['stppo.algos'] = None  # a broken import inside stppo\n"
            + LIST_STPPO)
    out = run_python(code)
    assert out.returncode == 0, out.stderr  # verl itself swallows the plugin's error ...
    assert out.stdout.strip() == "[]"
    # ... but the plugin has said so, at WARNING level, with the cause
    assert "stppo's verl plugin failed to load (ModuleNotFoundError" in out.stderr
    assert "stppo_* policy losses are NOT registered" in out.stderr


def test_importing_a_broken_plugin_directly_raises():
    code = ("import sys\nsys.modules['stppo.algos'] = None\n"
            "import stppo.integrations.verl.config")
    out = run_python(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert out.returncode != 0
    assert "stppo's verl plugin failed to load" in out.stderr
    assert "ModuleNotFoundError" in out.stderr.splitlines()[-1]


def test_register_refuses_a_name_held_by_another_loss():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from stppo.integrations.verl import plugin

    ours = POLICY_LOSS_REGISTRY["stppo_ppo"]
    assert plugin.register() == tuple(f"stppo_{p}" for p in PRESETS)  # again: a no-op
    assert POLICY_LOSS_REGISTRY["stppo_ppo"] is ours
    POLICY_LOSS_REGISTRY["stppo_ppo"] = POLICY_LOSS_REGISTRY["vanilla"]
    try:
        with pytest.raises(ValueError, match="'stppo_ppo' is already registered by"):
            plugin.register()
    finally:
        POLICY_LOSS_REGISTRY["stppo_ppo"] = ours
