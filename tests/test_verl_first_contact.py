"""backend=verl on first contact, without a verl process: every shipped experiment composes verl
settings, a CPU experiment asks only for a pretrained model, `trainer.on_alarm=rollback` is one
line (verl has no rollback), and the metric mapping in docs/design.md is the code's table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stppo.config import compose, to_config
from stppo.integrations.verl import launcher as L

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_shipped_experiment_composes_verl_lengths(experiment):
    """backend=verl with a shipped experiment (and a pretrained model where the experiment's is a
    CPU one): verl's prompt and response lengths split the experiment's context."""
    cfg = to_config(compose(["backend=verl", f"+experiment={experiment}", "model=qwen2_5_0_5b"]))
    ov = dict(a.split("=", 1) for a in L.make_plan(cfg, run_id="x").argv[3:])
    prompt, response = int(ov["data.max_prompt_length"]), int(ov["data.max_response_length"])
    assert prompt + response == cfg.trainer.rollout.max_total_tokens and 128 <= prompt <= 512 and response >= 256
    assert ov["+actor_rollout_ref.actor.policy_loss.max_turns"] == str(cfg.task.max_turns)


def test_first_contact_with_a_cpu_experiment_is_one_line_about_the_model(tmp_path):
    """`run.py backend=verl +experiment=quick`: the only thing verl cannot take is the random-init
    model (lengths, warm start and prompt follow the backend); with a pretrained one the dry run
    prints verl's command."""
    base = [sys.executable, "run.py", "backend=verl", "+experiment=quick", "backend.dry_run=true",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={tmp_path}/run"]
    out = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        "run.py: error: model=tiny is a random preset built by stppo's own trainer; backend=verl needs a "
        "pretrained model: model=qwen2_5_* or model.path=DIR")
    out = subprocess.run([*base, "model=qwen2_5_0_5b"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "data.max_prompt_length=256" in out.stdout and "data.max_response_length=256" in out.stdout


def test_rollback_with_verl_is_one_line_before_anything_starts():
    with pytest.raises(ValueError, match=r"^trainer.on_alarm=rollback: verl has no rollback .* use "
                                         r"trainer.on_alarm=stop"):
        to_config(compose(["backend=verl", "trainer.on_alarm=rollback", "trainer.save_every=0"]))


def test_the_metric_mapping_in_docs_is_the_codes_table():
    from stppo.integrations.verl.metrics import table_markdown

    assert table_markdown() in (ROOT / "docs" / "design.md").read_text()
