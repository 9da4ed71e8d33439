"""Reducing per-minibatch metrics to one value per step: mean over
minibatches, except `*_max` keys (max) and `*_min` keys (min)."""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import torch

from stppo.metric_names import reduce_name


class MetricAccumulator:
    def __init__(self) -> None:
        self._values: dict[str, list[torch.Tensor]] = defaultdict(list)

    def add(self, metrics: Mapping[str, torch.Tensor | float]) -> None:
        for k, v in metrics.items():
            self._values[k].append(torch.as_tensor(v, dtype=torch.float64).detach().reshape(()))

    def reduce(self) -> dict[str, float]:
        out = {}
        for k, vs in self._values.items():
            x = torch.stack(vs)
            how = reduce_name(k)
            out[k] = float(x.max() if how == "max" else x.min() if how == "min" else x.mean())
        return out
