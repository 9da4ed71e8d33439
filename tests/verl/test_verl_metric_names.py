"""The verl keys of the mapping table (`stppo.integrations.verl.metrics`) are the ones verl's own
metric code produces and its MLflow logger stores: the validation key from `_val_metrics_update`
with a float reward (recorded as 'acc' by the naive reward manager), sanitised by
`_MlflowLoggingAdapter`; the training keys from `compute_data_metrics` and
`compute_timing_metrics`. The default (v1) trainer's `_val_metrics_update` in
`trainer/ppo/v1/trainer_base.py` builds the keys with the same rule, but its module imports
TransferQueue (verl's `verl-core` extra, not in this environment), so the legacy trainer's
method is the one called here."""

from __future__ import annotations

import numpy as np
import torch

from stppo.integrations.verl.metrics import NONFINITE_KEYS, STEP_KEY, TRAIN_COPIES, val_key


def test_the_validation_key_is_verls_core_metric_as_mlflow_stores_it():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.tracking import _MlflowLoggingAdapter

    scores = [1.0, 0.0, 1.0, 1.0]
    metrics = RayPPOTrainer._val_metrics_update(None, ["synthetic_multihop"] * 4, ["a", "b", "c", "d"],
                                                {"reward": scores, "acc": scores}, [np.array([2, 4, 2, 2])])
    core = [k for k in metrics if k.startswith("val-core/")]
    assert core == ["val-core/synthetic_multihop/acc/mean@1"] and metrics[core[0]] == 0.75
    assert _MlflowLoggingAdapter()._sanitize_key(core[0]) == val_key("synthetic_multihop")


def test_the_training_keys_are_verls_data_and_timing_metrics():
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_timing_metrics

    b, p, t = 4, 3, 5
    scores = torch.zeros(b, t)
    scores[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])  # outcome reward on the last token
    batch = DataProto.from_dict(
        tensors={"token_level_scores": scores, "token_level_rewards": scores - 0.01, "advantages": torch.randn(b, t),
                 "returns": torch.randn(b, t), "values": torch.randn(b, t), "responses": torch.ones(b, t, dtype=torch.long),
                 "prompts": torch.ones(b, p, dtype=torch.long), "attention_mask": torch.ones(b, p + t, dtype=torch.long),
                 "response_mask": torch.ones(b, t, dtype=torch.long)},
        non_tensors={"__num_turns__": np.array([2, 4, 6, 4], dtype=np.int32)})
    metrics = {**compute_data_metrics(batch, use_critic=True),
               **compute_timing_metrics(batch, {"step": 2.0, "gen": 1.0})}
    assert metrics[STEP_KEY] == 0.5 and metrics["num_turns/mean"] == 4.0
    missing = [c.verl for c in TRAIN_COPIES if c.verl not in metrics]
    assert not missing, missing
    assert {"response_length/mean", "response_length/clip_ratio"} <= set(metrics)
    assert set(NONFINITE_KEYS) == {"actor/grad_norm", "actor/pg_loss"}  # verl's actor update metrics
