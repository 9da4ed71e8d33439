"""One PPO update of a fixed global batch, run under torchrun with 1 or 2 processes.

    python -m torch.distributed.run --nproc_per_node=P tests/dp_update.py OUT.pt

Every process builds the same tiny Qwen2 policy, critic and global batch (8 trajectories in
4 groups of 2, multi-turn layout), keeps its share of the groups (`Dist.shard` of the trainer's
rule: whole groups per rank), then runs the trainer's own `prepare_batch`, `actor_update` and
`critic_update`, each case also with micro-batches of `MICRO` rows. Rank 0 saves the gradients
of every optimizer step (summed over ranks, before the step), the updated parameters and the
step's metrics (reduced over ranks); tests/test_distributed.py compares the 1- and 2-process
files.

Everything runs in float64 with plain SGD: a reorganisation (ranks, micro-batches) may change
only the order of sums, so the two runs agree to float64 rounding, and SGD moves the weights by
lr × gradient, which carries that rounding through unchanged (Adam's m/√v turns rounding noise
on a near-zero gradient into a step of ~lr, whatever the kernels).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from layouts import multi_turn_layout
from numerics import RecordingSGD
from stppo.batch import Batch
from stppo.config import AlgoConfig, TrainerConfig
from stppo.models import ValueModel
from stppo.train import distributed
from stppo.train.prepare import prepare_batch, set_subsentence_ends
from stppo.train.update import UpdateContext, actor_update, critic_update

N_GROUPS, GROUP, T, VOCAB = 4, 2, 28, 48
MICRO = 2  # rows per micro-batch: 4 parts in one process, 2 per rank in two
ACTOR_LR, CRITIC_LR = 3.0, 1.0  # SGD: large enough that the second epoch is off-policy (clips bind)

# name -> algo overrides: every ratio level, advantage estimator and correction whose statistics
# must be global (whitening, clip_bias/norm, the clip-triggered ratio, the grad estimator). Small
# τ make the corrections act on the second epoch's clipped tokens.
CASES = {
    "ppo": dict(name="ppo", ratio_level="token", advantage="gae", use_critic=True),
    "st_ppo": dict(name="st_ppo", ratio_level="turn", advantage="gae", use_critic=True,
                   clip_bias={"kind": "clip_bias_norm", "tau": 0.05}),
    "s_ppo_grad": dict(name="s_ppo", ratio_level="sequence", advantage="gae", use_critic=True,
                       clip_bias={"kind": "clip_bias_norm", "tau": 1e-4, "estimator": "grad"}),
    "so_grpo": dict(name="so_grpo", ratio_level="sequence", advantage="grpo", use_critic=False,
                    clip_bias={"kind": "clip_triggered", "tau": 0.1}),
    "turn_ppo_kl": dict(name="turn_ppo", ratio_level="turn", advantage="gae", use_critic=True,
                        loss_agg="token-mean", kl={"coef": 0.1}),
    # a researcher's stabiliser (tests/plugin_example): its preset file, a bigger β
    "turn_drift": dict(name="turn_drift", loss_options={"beta": 0.5}),
    # SSPO: subsentences from the policy's delimiter table, per shard; the optimal token
    # baseline: the old forward's Σπ² and the decoupled correction's IS weights, per group (a
    # group never spans ranks)
    "sspo": dict(name="sspo"),
    "tir_optimal_token_baseline": dict(name="tir_optimal_token_baseline",
                                       rollout_correction="decoupled_token_is"),
    # rollout corrections whose weights and metrics are statistics of the whole batch: decoupled
    # sequence IS normalised by the batch mean, with rejection (once per step, in the
    # preparation); bypass REINFORCE with normalised weights (in the loss, a batch statistic)
    # and the clip loss with geometric rejection against π_rollout
    "seq_is_rs": dict(name="grpo", advantage="grpo", use_critic=False,
                      rollout_correction="decoupled_seq_is_rs",
                      rollout_correction_options={"rs_threshold": "0.7_1.4", "batch_normalize": True}),
    "bypass_pg": dict(name="grpo", advantage="grpo", use_critic=False, rollout_correction="bypass_pg_is",
                      rollout_correction_options={"batch_normalize": True, "threshold": 1.2}),
    "bypass_clip": dict(name="ppo", ratio_level="token", advantage="gae", use_critic=True,
                        rollout_correction="bypass_ppo_clip_geo_rs",
                        rollout_correction_options={"rs_threshold": "0.95_1.05"}),
}
# The sampler's per-row drift from π_old (a rollout correction's cases): rows 3 and 5 far off
SAMPLER_DRIFT = (0.0, 0.02, -0.01, 0.5, 0.03, -0.6, 0.0, 0.01)


def algo_config(case: str) -> AlgoConfig:
    from stppo.config import to_config, compose
    overrides = [f"algo={CASES[case]['name']}"]
    cfg = to_config(compose(overrides))
    a = cfg.algo
    for k, v in CASES[case].items():
        if k == "clip_bias":
            a = replace(a, clip_bias=replace(a.clip_bias, **v))
        elif k == "kl":
            a = replace(a, kl=replace(a.kl, **v))
        elif k == "rollout_correction_options":
            a = replace(a, rollout_correction_options=replace(a.rollout_correction_options, **v))
        elif k != "name":
            a = replace(a, **{k: v})
    return a


def global_batch() -> Batch:
    """A deterministic multi-turn batch: prompt, then agent turns separated by observations."""
    g = torch.Generator().manual_seed(1234)
    ids, attn, loss, turns = multi_turn_layout(g, N_GROUPS * GROUP, T, VOCAB, prompt=4, action=(2, 6),
                                               gap=(2, 5), shortest=8)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss, turn_ids=turns,
                 group_ids=torch.arange(N_GROUPS).repeat_interleave(GROUP), scores=scores)


def models():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True)
    policy = Qwen2ForCausalLM(config).double()
    set_subsentence_ends(policy, torch.arange(VOCAB) % 5 == 0)  # SSPO: ids 0, 5, 10, … end one
    critic = ValueModel.from_policy(policy)
    return policy, critic


def run_case(case: str, d: distributed.Dist, micro: int = 0) -> dict:
    algo = algo_config(case)
    # 2 epochs of one global minibatch: the second epoch is off-policy (clipped tokens, λ < 1);
    # `micro` > 0: each rank accumulates its rows `micro` at a time (trainer.micro_batch_size)
    trainer = TrainerConfig(ppo_epochs=2, minibatch_size=N_GROUPS * GROUP, max_grad_norm=1e9,
                            exact_clip_bias_every=1, micro_batch_size=micro)
    policy, critic = models()
    ref = None
    if algo.kl.coef > 0:
        from stppo.models import reference_model
        ref = reference_model(policy)
    critic = critic if algo.use_critic else None
    full = global_batch()
    if algo.rollout_correction != "none":  # the sampler: π_old off by SAMPLER_DRIFT and noise
        from stppo.models import policy_log_probs
        with torch.no_grad():
            lp = policy_log_probs(policy, full.input_ids, full.attention_mask, positions=full.loss_mask)
        noise = 0.01 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(5))
        drift = torch.tensor(SAMPLER_DRIFT)[:, None]
        full = replace(full, rollout_log_probs=torch.where(full.loss_mask, lp - drift + noise, 0.0))
    mine = torch.tensor([i for i in range(len(full)) if int(full.group_ids[i]) % d.world == d.rank])
    batch, metrics = prepare_batch(full.select(mine), policy, critic, ref, algo, reduce=d.reduce,
                                   gather=d.gather_rows if d.active else None)
    ctx = UpdateContext(algo, trainer, torch.Generator().manual_seed(0), dist=d)
    actor_opt = RecordingSGD(policy.parameters(), lr=ACTOR_LR)
    metrics.update(actor_update(policy, actor_opt, batch, ctx))
    critic_opt = None
    if critic is not None:
        critic_opt = RecordingSGD(critic.parameters(), lr=CRITIC_LR)
        metrics.update(critic_update(critic, critic_opt, batch, ctx))
    metrics = d.reduce_metrics(metrics)
    return {"policy": {k: v.detach().clone() for k, v in policy.state_dict().items()},
            "critic": critic.state_dict() if critic is not None else None,
            "actor_grads": actor_opt.grads, "critic_grads": critic_opt.grads if critic_opt else None,
            "advantages": batch.advantages, "rows": mine, "metrics": metrics}


def main(out: str) -> None:
    torch.set_num_threads(1)
    d = distributed.init(torch.device("cpu"))
    results = {case: run_case(case, d) for case in CASES}
    results.update({f"{case}/micro": run_case(case, d, MICRO) for case in CASES})
    if d.world > 1:  # gather every rank's advantages so the test can compare whitening
        import torch.distributed as dist
        gathered = [None] * d.world
        dist.all_gather_object(gathered, {c: (r["rows"], r["advantages"]) for c, r in results.items()})
        for c in results:
            adv = torch.zeros_like(global_batch().input_ids, dtype=torch.float64)
            for part in gathered:
                rows, a = part[c]
                adv[rows] = a
            results[c]["advantages"] = adv
    if d.is_main:
        torch.save(results, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
