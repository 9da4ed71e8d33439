"""Shared pieces of the dashboard: the sidebar (tracking URI, experiments, Optuna storage) and the
cached loaders. Imports `analysis` only (never torch, never `stppo.train`).

Every store problem (missing file, unreachable server, unknown or empty experiment) becomes a
message on the page (st.info / st.warning), never a traceback.
"""

from __future__ import annotations

import os

import pandas as pd
import streamlit as st

import analysis
from analysis import samples as S
from analysis.axes import split_label, varies, with_axes
from analysis.store import AnalysisError, EmptyExperimentError
from analysis.summary import fmt_number
from analysis.sweeps import DEFAULT_STORAGE
from analysis.warning import AlarmConfig

URI_KEY, EXP_KEY, OPTUNA_KEY = "tracking_uri", "experiments", "optuna_storage"


def default_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


@st.cache_data(ttl=30, show_spinner=False)
def experiments(uri: str) -> dict[str, int]:
    """Experiment name -> run count."""
    return analysis.list_experiments(uri)


@st.cache_data(ttl=30, max_entries=8, show_spinner="Loading runs from MLflow…")
def study(uri: str, names: tuple[str, ...]) -> analysis.Study:
    return analysis.load_study(names, uri)


@st.cache_data(ttl=30, max_entries=8, show_spinner=False)
def run_tables(uri: str, names: tuple[str, ...]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-run table with the study's axes — lag, lag mode, rollout correction; `algo` the preset
    label, `grpo+decoupled_geo_rs` for a corrected run —, collapse table) of a study."""
    s = study(uri, names)
    collapse = analysis.collapse_table(s)
    return with_axes(analysis.per_run_table(s, collapse), s.params), collapse


@st.cache_data(ttl=30, max_entries=8, show_spinner="Computing the alarm statistics…")
def warning_stats(uri: str, names: tuple[str, ...], persist: int, baseline: int) -> pd.DataFrame:
    """The alarm statistic of every (run, indicator, step); it does not depend on the threshold."""
    cfg = AlarmConfig(persist=persist, baseline_steps=baseline)
    return analysis.run_statistics(study(uri, names), cfg)


@st.cache_data(ttl=30, max_entries=64, show_spinner=False)
def saved_steps(uri: str, run_id: str) -> list[int]:
    return S.saved_steps(uri, run_id)


@st.cache_data(ttl=300, max_entries=64, show_spinner="Reading the sampled trajectories…")
def samples(uri: str, run_id: str, step: int) -> pd.DataFrame:
    return S.load_samples(uri, run_id, step)


def chart(spec, note: str) -> None:
    """An interactive Altair chart, or `note` when there is nothing to draw."""
    if spec is None:
        st.info(note)
    else:
        st.altair_chart(spec, width="content")


def ordered_runs(kept: pd.DataFrame) -> dict[str, str]:
    """run_id -> label, earliest collapse first, then the runs without collapse."""
    order = kept.assign(_c=kept["collapse_step"].fillna(float("inf"))).sort_values(["_c", "algo", "model", "seed"])
    return {r["run_id"]: run_label(r) for _, r in order.iterrows()}


def sidebar() -> None:
    """Tracking URI, experiment picker, Optuna storage, reload; values land in st.session_state."""
    sb = st.sidebar
    sb.title("stppo · stability")
    uri = sb.text_input("MLflow tracking URI", value=default_uri(), key=URI_KEY).strip()
    try:
        counts = experiments(uri)
        st.session_state.pop("store_error", None)
    except AnalysisError as e:
        counts = {}
        st.session_state["store_error"] = str(e)
    names = list(counts)
    with_runs = [n for n in names if counts[n] > 0] or names
    sb.multiselect("Experiments", names, default=with_runs[:1], key=f"{EXP_KEY}::{uri}",
                   format_func=lambda n: f"{n} ({counts.get(n, 0)} runs)")
    sb.text_input("Optuna storage URL", value=os.environ.get("OPTUNA_STORAGE") or DEFAULT_STORAGE, key=OPTUNA_KEY)
    if sb.button("Reload from the store"):
        st.cache_data.clear()


def selection() -> tuple[str, tuple[str, ...]]:
    uri = str(st.session_state.get(URI_KEY, default_uri())).strip()
    return uri, tuple(st.session_state.get(f"{EXP_KEY}::{uri}", ()))


def current_study() -> analysis.Study | None:
    """The selected study, or None after putting the reason on the page."""
    uri, names = selection()
    if "store_error" in st.session_state:
        st.warning(f"Cannot read the tracking store: {st.session_state['store_error']}")
        return None
    if not names:
        have = experiments(uri)
        if not have:
            st.info(f"The tracking store {uri} has no experiments yet. Run a study (python run.py) and reload.")
        else:
            st.info("Choose one or more experiments in the sidebar.")
        return None
    try:
        return study(uri, names)
    except EmptyExperimentError as e:
        st.info(f"{e}: nothing to show yet. Runs appear here once the trainer logs them.")
    except AnalysisError as e:
        st.warning(str(e))
    return None


def run_label(row: pd.Series) -> str:
    tail = f" — collapsed at step {int(row['collapse_step'])}" if row.get("collapsed") else ""
    name = f" · {row['run_name']}" if row.get("run_name") else ""
    return f"{row['algo']} · {row['model']} · seed {row['seed']}{name}{tail}"


def _fresh(widget: str, options: list) -> str:
    """The key of a multiselect whose default is all its options: when the options change (other
    experiments chosen) its last choice is dropped, so new values are not hidden by an old filter."""
    if st.session_state.get(f"{widget}::options") != options:
        st.session_state[f"{widget}::options"] = options
        st.session_state.pop(widget, None)
    return widget


def filters(runs: pd.DataFrame, *, key: str, columns: tuple[str, ...] = ("algo", "model", "seed")) -> pd.DataFrame:
    """Multiselects for preset/model/seed (all selected by default), and lag / lag mode where they
    vary; returns the kept rows."""
    labels = {"algo": "Preset", "model": "Model", "seed": "Seed", "task": "Task", "lag": "Lag", "lag_mode": "Lag mode"}
    columns = (*columns, *(c for c in ("lag", "lag_mode") if varies(runs, c)))
    cols = st.columns(len(columns))
    keep = pd.Series(True, index=runs.index)
    for col, name in zip(cols, columns):
        options = list(dict.fromkeys(runs[name].astype(str)))
        options = sorted(options, key=int) if name == "lag" else options
        chosen = col.multiselect(labels.get(name, name), options, default=options, key=_fresh(f"{key}:{name}", options))
        keep &= runs[name].astype(str).isin(chosen)
    return runs[keep]


def page_runs(key: str, columns: tuple[str, ...] = ("algo", "model", "seed"),
              ) -> tuple[analysis.Study, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A page's prologue: the current study, its runs and collapse table, and the runs the
    page's filters keep. Stops the page with a message when there is nothing to show."""
    study = current_study()
    if study is None:
        st.stop()
    runs, collapse = run_tables(study.uri, study.experiments)
    kept = filters(runs, key=key, columns=columns)
    if kept.empty:
        st.info("No run matches the filters.")
        st.stop()
    return study, runs, collapse, kept


SPLITS = {"experiment": "level (experiment)", "lag": "lag", "lag_mode": "lag mode"}


def split_by(runs: pd.DataFrame, key: str) -> tuple[str, ...]:
    """A multiselect of the study's axes that vary among `runs` (level = experiment, lag, lag
    mode; all chosen by default): the columns a page splits its presets by. Nothing to choose,
    nothing shown."""
    options = [c for c in SPLITS if varies(runs, c)]
    if not options:
        return ()
    return tuple(st.multiselect("Split presets by", options, default=options, format_func=SPLITS.get,
                                key=_fresh(f"{key}:split", options)))


def series_metrics(metrics: pd.DataFrame, runs: pd.DataFrame, split: tuple[str, ...]) -> pd.DataFrame:
    """The metrics of `runs` with `algo` set to each run's preset label and the values of `split`
    that vary (`ppo · lag 2`): one curve per label in the band charts."""
    labels = dict(zip(runs["run_id"].astype(str), split_label(runs, split)))
    mine = metrics[metrics["run_id"].isin(list(labels))]
    return mine.assign(algo=mine["run_id"].astype(str).map(labels).astype("category"))


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def pretty(frame: pd.DataFrame) -> pd.DataFrame:
    """Floats as short strings (NaN as –, whole numbers without decimals) for st.table (HTML)."""
    out = frame.copy()
    for col in out.columns:
        if pd.api.types.is_float_dtype(out[col]):
            whole = bool(out[col].dropna().map(float.is_integer).all())
            out[col] = out[col].map(lambda v: fmt_number(v) if not whole or v != v else str(int(v)))
    return out
