"""Sampled trajectories of synthetic runs, written as the trainer writes them: one MLflow table
artifact `samples/step_{step:06d}.json` per saved step (`MlflowClient.log_table`, columns
`tracking.SAMPLE_COLUMNS`, one row per segment) and the run tag `samples_steps`.

Before the collapse a trajectory searches, reads the observation and answers (reward 1 when the
answer is right); after it, the agent emits junk (invalid actions, the environment's invalid-action
observation) and gets reward 0.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from stppo import metric_names as T

PEOPLE = (("Ada Brenner", "Paris"), ("Jon Okafor", "Lagos"), ("Mei Tanaka", "Osaka"), ("Lars Vik", "Bergen"),
          ("Rosa Quint", "Porto"))
INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
           "</search>. If I want to give the final answer, I should put the answer between <answer> and "
           "</answer>. Let me try again.\n")


def _row(step, sample, q, answers, reward, segment, role, turn, text, action, ratio=(np.nan, np.nan),
         adv=np.nan, collapse_step=-1) -> dict:
    return dict(zip(T.SAMPLE_COLUMNS, (step, sample, q, answers, reward, segment, role, turn, text, action,
                                       ratio[0], ratio[1], adv, collapse_step)))


def synthetic_samples(step: int, count: int, *, collapsed: bool, collapse_step: int = -1,
                      seed: int = 0) -> pd.DataFrame:
    """`count` trajectories at `step` (see the module docstring) as the rows of one samples table."""
    rng = np.random.default_rng([seed, step])
    rows = []
    for i in range(count):
        name, city = PEOPLE[(i + step) % len(PEOPLE)]
        q = f"Question: In which city was {name} born?"
        right = not collapsed and rng.random() < 0.8
        reward = 1.0 if right else 0.0
        adv = (reward - 0.5) * 2 + rng.normal(0, 0.05)
        head = dict(step=step, sample=i, q=q, answers=f"{city} | {city.lower()}", reward=reward,
                    collapse_step=collapse_step)
        segs = [("prompt", -1, f"Answer the question. You can search. {q}", "")]
        if collapsed:
            segs += [("agent", 0, "the the <sear answer answer", "invalid"), ("observation", -1, INVALID, ""),
                     ("agent", 1, "<<search search> </", "invalid"), ("observation", -1, INVALID, "")]
        else:
            said = city if right else PEOPLE[(i + step + 1) % len(PEOPLE)][1]
            doc = f'Doc 1(Title: "{name}") {name} was born in {city}.'
            segs += [("agent", 0, f"<search> {name} birthplace </search>", "search"),
                     ("observation", -1, f"\n\n<information>{doc}</information>\n\n", ""),
                     ("agent", 1, f"<answer> {said} </answer>", "answer")]
        for j, (role, turn, text, action) in enumerate(segs):
            agent = role == "agent"
            r = (1 + rng.normal(0, 0.02 if not collapsed else 0.3), 1.1 + (2.0 if collapsed else 0.0)) if agent \
                else (np.nan, np.nan)
            rows.append(_row(head["step"], i, q, head["answers"], reward, j, role, turn, text, action, r,
                             adv if agent else np.nan, collapse_step))
    return pd.DataFrame(rows, columns=list(T.SAMPLE_COLUMNS))


def sample_steps(series: Mapping[str, Sequence[tuple[int, float]]], every: int) -> tuple[list[int], int, int]:
    """(steps to save, collapse onset or -1, step the collapse was detected or -1) of a run."""
    steps = sorted({int(s) for pts in series.values() for s, _ in pts if s >= 1})
    found = series.get(T.COLLAPSE_STEP, [])
    onset, detected = (int(found[0][1]), int(found[0][0])) if found else (-1, -1)
    saved = {s for s in steps if s % every == 0} | ({detected} if detected > 0 else set())
    return sorted(saved), onset, detected


def write_samples(client, run_id: str, series: Mapping[str, Sequence[tuple[int, float]]], *, every: int,
                  count: int, seed: int = 0) -> list[int]:
    """Log the samples tables of a run (every `every` steps and at the detected collapse) and the
    `samples_steps` tag; returns the steps written."""
    steps, onset, detected = sample_steps(series, every)
    for step in steps:
        known = detected > 0 and step >= detected
        frame = synthetic_samples(step, count, collapsed=onset > 0 and step >= onset,
                                  collapse_step=onset if known else -1, seed=seed)
        client.log_table(run_id, frame, T.samples_artifact(step))
    client.set_tag(run_id, T.TAG_SAMPLES_STEPS, ",".join(map(str, steps)))
    return steps
