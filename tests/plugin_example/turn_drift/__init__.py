"""turn_drift: an stppo stabiliser (docs/extending.md). The loss is `turn_drift.loss:turn_drift`;
the preset file `turn_drift/conf/algo/turn_drift.yaml` names it:

    python run.py hydra.searchpath=[pkg://turn_drift.conf] algo=turn_drift
"""
