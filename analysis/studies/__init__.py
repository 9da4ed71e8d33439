"""The published studies, one module each (docs/results/): the design's tables, contrasts and
figures of a study from its runs, each a command, `python -m analysis.studies.<study>`.

    frontier           study v2: the stability frontier along the off-policy levels
    critic_warmstart   its critic warm-start comparison
    staleness          study v3: stale rollouts and the rollout corrections (with
                       staleness_runs: its parts, staleness_contrasts: C1–C8, staleness_figures)
    combined_warning   one alarm from every indicator, cross-validated
    testbed            the testbed's calibration table and targets

They read the library (`analysis`), never the other way round.
"""
