"""trainer.critic_warmstart: the critic regressed on the warm-started policy's own Monte-Carlo
returns before RL — it explains more of the held-out returns after than before, is cached and
shared by every preset, and its figures are logged at step 0."""

from __future__ import annotations

import torch
from mlflow.tracking import MlflowClient

from stppo import metric_names as K
from stppo.config import to_config
from stppo.train.critic_warmstart import returns_of
from stppo.train.job import run
from stppo.train.setup import build_components

CW = ("trainer.critic_warmstart.enabled=true", "trainer.critic_warmstart.questions=80",
      "trainer.critic_warmstart.steps=60", "trainer.critic_warmstart.batch_size=16")


def test_returns_are_the_discounted_score_over_agent_tokens():
    from stppo.batch import Batch

    mask = torch.tensor([[0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    b = Batch(input_ids=torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.ones(1, 6, dtype=torch.bool),
              loss_mask=mask, turn_ids=torch.tensor([[-1, 0, 0, -1, 1, -1]]),
              group_ids=torch.zeros(1, dtype=torch.long), scores=torch.tensor([1.0]))
    g = returns_of(b, gamma=0.5)
    assert g.tolist() == [[0.0, 0.25, 0.5, 0.0, 1.0, 0.0]]  # observation tokens skipped


def test_critic_warm_start_raises_explained_variance_and_is_shared(tiny_cfg, tmp_path):
    cfg = to_config(tiny_cfg("algo=ppo", "tracking.enabled=false", *CW))
    comps = build_components(cfg, progress=False)
    m = comps.critic_warmstart
    assert set(m) == {K.CRITIC_WS_EV_BEFORE, K.CRITIC_WS_EV_AFTER, K.CRITIC_WS_LOSS}
    assert m[K.CRITIC_WS_EV_AFTER] > m[K.CRITIC_WS_EV_BEFORE] + 0.05, m
    # another GAE preset, another seed and lr: the same fitted critic, from the cache
    other = build_components(to_config(tiny_cfg("algo=st_ppo", "seed=3", "trainer.actor_lr=1e-3",
                                                "tracking.enabled=false", *CW)), progress=False)
    assert other.critic_warmstart == m
    for a, b in zip(comps.critic.state_dict().values(), other.critic.state_dict().values()):
        assert torch.equal(a, b)
    assert build_components(to_config(tiny_cfg("algo=grpo", "tracking.enabled=false", *CW)),
                            progress=False).critic_warmstart == {}  # no critic, nothing to fit

    run(tiny_cfg("algo=ppo", "trainer.total_steps=1", *CW))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (r,) = client.search_runs([client.get_experiment_by_name("stppo").experiment_id])
    hist = client.get_metric_history(r.info.run_id, K.CRITIC_WS_EV_AFTER)
    assert [(h.step, h.value) for h in hist] == [(0, m[K.CRITIC_WS_EV_AFTER])]
