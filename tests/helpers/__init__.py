"""Helpers of the tests, imported by name (`from helpers.algos import make_inputs`):

    algos   multi-turn inputs and plain-loop references of the loss functions
    stores  real MLflow stores with known runs, and their pytest fixtures
    updates a tiny float64 policy and a multi-turn training batch

Synthetic runs written as the trainer writes them are in `tests/fixtures/`.
"""
