"""HTML of one sampled trajectory for the Samples page (`st.html`): every text is escaped; agent
turns carry a badge for their action (search, answer, invalid) with the turn's ratio and advantage,
the `<search>` / `<answer>` spans inside them are highlighted, observations are set apart
(monospace on a tinted background, labelled), the prompt is folded."""

from __future__ import annotations

import html
import math
import re

BADGES = {"search": ("tool call: search", "#1565c0", "#e3f2fd"), "answer": ("answer", "#2e7d32", "#e8f5e9"),
          "invalid": ("invalid action", "#c62828", "#ffebee"), "": ("agent", "#555", "#f5f5f5")}
TAGS = re.compile(r"(&lt;(search|answer)&gt;.*?&lt;/\2&gt;)", re.DOTALL)
TAG_STYLE = {"search": "background:#bbdefb;border-radius:3px", "answer": "background:#c8e6c9;border-radius:3px"}
BOX = "border-radius:6px;padding:6px 10px;margin:4px 0;white-space:pre-wrap;word-break:break-word"


def _num(v, fmt: str = "{:.3f}") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def mark_actions(text: str) -> str:
    """Escaped `text` with each complete <search>…</search> / <answer>…</answer> span highlighted."""
    return TAGS.sub(lambda m: f'<span style="{TAG_STYLE[m.group(2)]}">{m.group(1)}</span>', html.escape(text))


def segment_html(seg: dict) -> str:
    role = seg["role"]
    if role == "prompt":
        return (f'<details style="margin:4px 0"><summary style="color:#666">prompt</summary>'
                f'<div style="{BOX};background:#fafafa;color:#444">{html.escape(seg["text"])}</div></details>')
    if role == "observation":
        return (f'<div style="{BOX};background:#f1f8e9;border-left:4px solid #9e9d24;font-family:monospace;'
                f'font-size:0.85em;color:#33691e"><b style="font-family:sans-serif">observation</b>\n'
                f'{html.escape(seg["text"].strip(chr(10)))}</div>')
    label, fg, bg = BADGES.get(seg["action"], BADGES[""])
    stats = (f'turn {seg["turn"]} · ratio mean {_num(seg["ratio_mean"])} (max {_num(seg["ratio_max"])}) · '
             f'advantage {_num(seg["advantage_mean"], "{:+.3f}")}')
    return (f'<div style="{BOX};background:{bg};border-left:4px solid {fg}">'
            f'<span style="background:{fg};color:white;border-radius:10px;padding:1px 8px;font-size:0.8em">'
            f'{label}</span> <span style="color:#555;font-size:0.8em">{stats}</span>\n'
            f'{mark_actions(seg["text"])}</div>')


def trajectory_html(traj: dict, *, show_prompt: bool = False) -> str:
    """One sample: a header (question, gold answers, reward) and its segments in order."""
    reward = traj["reward"]
    color = "#2e7d32" if reward > 0 else "#c62828"
    head = (f'<div style="font-weight:600">sample {traj["sample"]} · reward '
            f'<span style="color:{color}">{_num(reward, "{:g}")}</span></div>'
            f'<div>{html.escape(traj["question"])} <span style="color:#666">gold: '
            f'{html.escape(traj["answers"])}</span></div>')
    body = "".join(segment_html(s) for s in traj["segments"] if show_prompt or s["role"] != "prompt")
    return f'<div style="border:1px solid #ddd;border-radius:8px;padding:8px 12px;margin:8px 0">{head}{body}</div>'
