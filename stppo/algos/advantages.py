"""Advantage estimators (docs/design.md §2, "Advantages"); no gradient flows through them.

GAE over agent tokens only. Let t_1 < t_2 < … < t_L be row i's agent positions (m = 1). Then
    δ_j = r_{t_j} + γ V_{t_{j+1}} − V_{t_j}          (V_{t_{L+1}} = 0)
    A_{t_j} = δ_j + γλ A_{t_{j+1}},   R_{t_j} = A_{t_j} + V_{t_j}
i.e. the recursion skips prompt / observation / padding positions: the "next value" of an agent
token is the value at the next agent token of the same row. `values[:, t]` is the critic's
estimate for the state in which token t is generated (aligned like log_probs); values and rewards
off agent tokens have no effect (rewards belong on agent tokens: the outcome at the last one).

GRPO (group-relative): A_i = (R_i − mean_g R) / (std_g R + ε) with the *unbiased* std (as verl's
torch.std), 0 for groups of one, broadcast to the trajectory's agent tokens.

RLOO (leave-one-out, arXiv 2402.14740; verl `compute_rloo_outcome_advantage`): with R_i the sum of
the trajectory's token rewards (the outcome, plus −β·KL when the KL is in the reward) and n its
group's size, A_i = R_i − mean_{j≠i} R_j = n/(n−1) (R_i − mean_g R); a group of one keeps A_i = R_i
(verl's 'rloo'; its 'rloo_vectorized' gives 0 there). No critic, no whitening.

REINFORCE++ (arXiv 2501.03262; verl `compute_reinforce_plus_plus_outcome_advantage`): the
discounted return over agent tokens, G_{t_j} = Σ_{k≥j} γ^{k−j} r_{t_k} (observation positions are
skipped, as in GAE: it is GAE with V ≡ 0 and λ = 1), whitened over the batch's agent tokens;
returns = G.

TIR optimal token baseline (verl 0.9.1 `compute_multi_turn_optimal_token_baseline_advantage`,
`algorithm.adv_estimator=tir_optimal_token_baseline`; verl's docs/algo/otb.md): a baseline per
token position, weighted by each trajectory's accumulated policy-gradient energy. Let
t_1 < … < t_L be trajectory i's agent positions (observations between turns are skipped: the
tool-integrated, multi-turn form compacts the agent tokens, so position j is the j-th agent
token), r its token rewards, π_old(y_t) the sampled token's probability and Σπ²_t = Σ_v π_old(v | s_t)²
(from the old-policy forward). Then, with γ = 1 (verl's),

    G_{i,j} = Σ_{k ≥ j} r_{t_k},    w_{i,j} = (1 − 2 π_old(y_{t_j}) + Σπ²_{t_j}) · ω_{t_j}²,
    W_{i,j} = Σ_{k ≤ j} w_{i,k}                (ω: the rollout IS weights, 1 without TIS)
    B_{g,j} = Σ_{i∈g} G_{i,j} W_{i,j} / (Σ_{i∈g} W_{i,j} + ε),   A_{i,j} = G_{i,j} − B_{g(i),j}

over the members i of group g that have a j-th agent token (ε = 1e-8); a group of one member
(rows without agent tokens do not count) keeps A = G. Zero tail: when exactly one member is the
longest, B = 0 on its positions j ≥ the second-longest length (there B would equal its own G).
1 − 2π + Σπ² = ‖e_y − π‖², the squared norm of the logits' gradient of log π(y): the
"logit-gradient proxy" of the path's variance. No whitening, no critic; returns = G.

Turn-level GAE (option): one step per turn — the turn's reward is the sum of its tokens' rewards
(the outcome lands in the last turn), its value is the value at the turn's first agent token; γ
and λ apply per turn; advantages and returns are broadcast to the turn's tokens.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from stppo.registry import Registry

WHITEN_EPS = 1e-8


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float,
        gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (N, T) and 0 off agent tokens; see the module docstring.

    Agent tokens are compressed to the left of each row (a stable sort of ~mask), so the
    backward scan runs over the longest row's agent-token count, vectorised over rows.
    """
    n, t = loss_mask.shape
    dtype = values.dtype if values.is_floating_point() else torch.float32
    adv = torch.zeros(n, t, dtype=dtype, device=values.device)
    length = int(loss_mask.sum(dim=1).max()) if loss_mask.numel() else 0
    if length == 0:
        return adv, adv.clone()
    order = torch.sort((~loss_mask).to(torch.uint8), dim=1, stable=True).indices[:, :length]
    m_c = loss_mask.gather(1, order)  # (N, L) True then False per row
    r_c = torch.where(m_c, rewards.gather(1, order).to(dtype), 0.0)  # (N, L)
    v_c = torch.where(m_c, values.gather(1, order).to(dtype), 0.0)  # (N, L)
    v_next = torch.nn.functional.pad(v_c[:, 1:], (0, 1))  # (N, L), 0 after the last agent token
    deltas = r_c + gamma * v_next - v_c  # (N, L), 0 on the padded tail
    adv_c = torch.empty_like(deltas)
    last = torch.zeros(n, dtype=dtype, device=values.device)  # (N,)
    for j in range(length - 1, -1, -1):  # scan over time, vectorised over rows
        last = deltas[:, j] + (gamma * gae_lambda) * last
        adv_c[:, j] = last
    adv.scatter_(1, order, torch.where(m_c, adv_c, 0.0))
    returns = torch.where(loss_mask, adv + torch.where(loss_mask, values.to(dtype), 0.0), 0.0)
    return adv, returns


@torch.no_grad()
def masked_whiten(x: torch.Tensor, loss_mask: torch.Tensor, shift_mean: bool = True,
                  reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + 1e-8) over agent tokens (σ² unbiased, as verl); + μ back if not
    `shift_mean`. With `reduce` (an all-reduce sum over data-parallel shards) μ and σ² are those
    of every shard's agent tokens. (N, T), 0 off agent tokens."""
    reduce = reduce or (lambda t: t)
    xm = torch.where(loss_mask, x, 0.0)  # (N, T)
    n_sum = reduce(torch.stack([loss_mask.sum().to(xm.dtype), xm.sum()]))
    n = n_sum[0]
    mean = n_sum[1] / n.clamp(min=1)
    var = reduce(torch.where(loss_mask, (xm - mean).square(), 0.0).sum()) / (n - 1).clamp(min=1)
    out = (xm - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return torch.where(loss_mask, out, 0.0)


@torch.no_grad()
def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor,
                    eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """(R_i − mean_g) / (std_g + ε) per trajectory (unbiased std), or R_i − mean_g if not
    `norm_by_std`; 0 for groups of size 1; broadcast to agent tokens. scores, group_ids (N,)."""
    n = loss_mask.shape[0]
    if scores.dim() != 1 or group_ids.shape != scores.shape or scores.shape[0] != n:
        raise ValueError(f"scores and group_ids must have shape (N,) with N = loss_mask rows; got "
                         f"{tuple(scores.shape)}, {tuple(group_ids.shape)}, "
                         f"{tuple(loss_mask.shape)}")
    r = scores.to(torch.float32) if not scores.is_floating_point() else scores
    _, inv = torch.unique(group_ids, return_inverse=True)  # (N,) contiguous group index
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = r.new_zeros(g).index_add_(0, inv, torch.ones_like(r))  # (G,)
    mean = r.new_zeros(g).index_add_(0, inv, r) / count  # (G,)
    dev = r - mean[inv]  # (N,)
    var = r.new_zeros(g).index_add_(0, inv, dev.square()) / (count - 1).clamp(min=1)  # (G,)
    adv = dev / (var.sqrt()[inv] + eps) if norm_by_std else dev  # (N,)
    adv = torch.where(count[inv] > 1, adv, 0.0)
    return torch.where(loss_mask, adv.unsqueeze(1), 0.0)  # (N, T)


@torch.no_grad()
def turn_gae(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor,
             turn_ids: torch.Tensor, gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns (see the module docstring); (advantages, returns) (N, T)."""
    n, t = loss_mask.shape
    dtype = values.dtype if values.is_floating_point() else torch.float32
    if not loss_mask.any():
        z = torch.zeros(n, t, dtype=dtype, device=values.device)
        return z, z.clone()
    tid = torch.where(loss_mask, turn_ids, 0)  # (N, T)
    k = int(tid.max()) + 1
    seg = (torch.arange(n, device=tid.device).unsqueeze(1) * k + tid)[loss_mask]  # (M,)
    r_turn = torch.zeros(n * k, dtype=dtype, device=values.device).index_add_(
        0, seg, rewards[loss_mask].to(dtype)).view(n, k)  # (N, K)
    pos = torch.arange(t, device=tid.device).expand(n, t)[loss_mask]  # (M,)
    first = torch.full((n * k,), t, device=tid.device).scatter_reduce_(
        0, seg, pos, reduce="amin").view(n, k)  # (N, K) first agent position of each turn
    turn_mask = first < t  # (N, K)
    v_turn = torch.where(turn_mask, values.gather(1, first.clamp(max=t - 1)).to(dtype), 0.0)
    adv_turn, ret_turn = gae(r_turn, v_turn, turn_mask, gamma, gae_lambda)  # (N, K)
    adv = torch.where(loss_mask, adv_turn.gather(1, tid), 0.0)
    returns = torch.where(loss_mask, ret_turn.gather(1, tid), 0.0)
    return adv, returns


@torch.no_grad()
def tir_optimal_token_baseline(rewards: torch.Tensor, loss_mask: torch.Tensor,
                               group_ids: torch.Tensor, old_log_probs: torch.Tensor,
                               sum_pi_squared: torch.Tensor,
                               rollout_is_weights: Optional[torch.Tensor] = None,
                               handle_zero_tail: bool = True,
                               eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) (N, T), 0 off agent tokens, of the TIR optimal token baseline (module
    docstring). rewards, old_log_probs, sum_pi_squared, rollout_is_weights (or None): (N, T)
    floats, anything off agent tokens; loss_mask (N, T) bool; group_ids (N,). Agent tokens are
    compacted to the left of each row (a stable sort of ~mask, as `gae`); every reduction over a
    group is one index_add over the (N, L) compacted rows."""
    n, t = loss_mask.shape
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape (N,) = ({n},), got {tuple(group_ids.shape)}")
    for name, x in (("rewards", rewards), ("old_log_probs", old_log_probs),
                    ("sum_pi_squared", sum_pi_squared), ("rollout_is_weights", rollout_is_weights)):
        if x is not None and x.shape != loss_mask.shape:
            raise ValueError(f"{name} must have the shape of loss_mask {tuple(loss_mask.shape)}, "
                             f"got {tuple(x.shape)}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    adv = torch.zeros(n, t, dtype=dtype, device=rewards.device)
    lengths = loss_mask.sum(dim=1)  # (N,)
    length = int(lengths.max()) if n else 0
    if length == 0:
        return adv, adv.clone()
    order = torch.sort((~loss_mask).to(torch.uint8), dim=1, stable=True).indices[:, :length]
    m_c = loss_mask.gather(1, order)  # (N, L) agent tokens first, in position order

    def compact(x: torch.Tensor) -> torch.Tensor:
        return torch.where(m_c, x.gather(1, order).to(dtype), 0.0)  # (N, L)

    ret = compact(rewards).flip(1).cumsum(1).flip(1)  # (N, L) G: rewards-to-go, 0 past the end
    w = 1.0 - 2.0 * compact(old_log_probs).exp() + compact(sum_pi_squared)  # (N, L)
    if rollout_is_weights is not None:
        w = w * compact(rollout_is_weights).square()
    energy = torch.where(m_c, torch.where(m_c, w, 0.0).cumsum(1), 0.0)  # (N, L) W
    _, inv = torch.unique(group_ids, return_inverse=True)  # (N,)
    g = int(inv.max()) + 1
    real = lengths > 0  # (N,) rows without agent tokens join no group
    weight = real.to(dtype).unsqueeze(1)  # (N, 1)
    num = ret.new_zeros(g, length).index_add_(0, inv, ret * energy * weight)  # (G, L)
    den = ret.new_zeros(g, length).index_add_(0, inv, energy * weight)  # (G, L)
    members = lengths.new_zeros(g).index_add_(0, inv, real.long())  # (G,)
    base = (num / (den + eps))[inv]  # (N, L)
    base = torch.where((members[inv] > 1).unsqueeze(1), base, 0.0)
    if handle_zero_tail:
        base = _zero_tail(base, lengths, inv, real, g)
    adv_c = torch.where(m_c, ret - base, 0.0)  # (N, L)
    adv.scatter_(1, order, adv_c)
    returns = torch.zeros_like(adv).scatter_(1, order, torch.where(m_c, ret, 0.0))
    return adv, returns


def _zero_tail(base: torch.Tensor, lengths: torch.Tensor, inv: torch.Tensor, real: torch.Tensor,
               g: int) -> torch.Tensor:
    """B = 0 on a group's unique longest member past the second-longest length (verl's
    handle_zero_tail). base (N, L), lengths (N,), inv (N,) group index, real (N,) rows counted."""
    lens = torch.where(real, lengths, -1)  # (N,)
    longest = lens.new_full((g,), -1).scatter_reduce(0, inv, lens, reduce="amax")  # (G,)
    at_max = (lens == longest[inv]) & real  # (N,)
    n_at_max = lens.new_zeros(g).index_add_(0, inv, at_max.long())  # (G,)
    others = torch.where(at_max, -1, lens)  # (N,)
    second = lens.new_full((g,), -1).scatter_reduce(0, inv, others, reduce="amax")  # (G,)
    tail = at_max & (n_at_max[inv] == 1) & (second[inv] >= 0)  # (N,) the unique longest, N ≥ 2
    cols = torch.arange(base.shape[1], device=base.device)  # (L,)
    cut = tail.unsqueeze(1) & (cols.unsqueeze(0) >= second[inv].unsqueeze(1))  # (N, L)
    return torch.where(cut, 0.0, base)


# --- registry: one signature ---------------------------------------------------------------------
# estimator(*, loss_mask, turn_ids, rewards, values, scores, group_ids, gamma, gae_lambda, eps,
#           norm_by_std, whiten, reduce, old_log_probs, sum_pi_squared, rollout_is_weights)
#           -> (advantages (N, T), returns (N, T)); `reduce` (an all-reduce sum over
#           data-parallel shards, or None) makes whitening global. GRPO and the optimal token
#           baseline need none: a group never spans shards. The estimators of
#           OLD_POLICY_ESTIMATORS read π_old's forward: its log-probs and Σ_v π_old(v)² per agent
#           token (`sum_pi_squared`), and the TIS weights when the run has them.
OLD_POLICY_ESTIMATORS = ("tir_optimal_token_baseline",)
ADVANTAGE_ESTIMATORS: Registry[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = Registry(
    "advantage")


def _need(name: str, **inputs: Optional[torch.Tensor]) -> None:
    missing = [k for k, v in inputs.items() if v is None]
    if missing:
        raise ValueError(f"advantage={name!r} needs {', '.join(missing)} (got None)")


@ADVANTAGE_ESTIMATORS.register("gae")
def _gae_estimator(*, loss_mask, rewards, values, gamma, gae_lambda, whiten, reduce=None, **_):
    _need("gae", rewards=rewards, values=values)
    adv, ret = gae(rewards, values, loss_mask, gamma, gae_lambda)
    return (masked_whiten(adv, loss_mask, reduce=reduce) if whiten else adv), ret


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo_estimator(*, loss_mask, scores, group_ids, eps, norm_by_std, **_):
    _need("grpo", scores=scores, group_ids=group_ids)
    adv = grpo_advantages(scores, group_ids, loss_mask, eps, norm_by_std)
    return adv, adv.clone()  # no critic: returns = advantages (as verl)


@ADVANTAGE_ESTIMATORS.register("turn_gae")
def _turn_gae_estimator(*, loss_mask, turn_ids, rewards, values, gamma, gae_lambda, whiten, reduce=None,
                        **_):
    _need("turn_gae", rewards=rewards, values=values, turn_ids=turn_ids)
    adv, ret = turn_gae(rewards, values, loss_mask, turn_ids, gamma, gae_lambda)
    return (masked_whiten(adv, loss_mask, reduce=reduce) if whiten else adv), ret


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor,
                    loss_mask: torch.Tensor) -> torch.Tensor:
    """A_i = R_i − mean of the other members' R, R_i = Σ_t over agent tokens of rewards (N, T);
    R_i for groups of one; broadcast to agent tokens. (N, T)"""
    n = loss_mask.shape[0]
    if group_ids.shape != (n,) or rewards.shape != loss_mask.shape:
        raise ValueError(f"rewards must be (N, T) like loss_mask and group_ids (N,); got "
                         f"{tuple(rewards.shape)}, {tuple(group_ids.shape)}, "
                         f"{tuple(loss_mask.shape)}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = torch.where(loss_mask, rewards.to(dtype), 0.0).sum(dim=1)  # (N,)
    _, inv = torch.unique(group_ids, return_inverse=True)  # (N,)
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = r.new_zeros(g).index_add_(0, inv, torch.ones_like(r))[inv]  # (N,)
    total = r.new_zeros(g).index_add_(0, inv, r)[inv]  # (N,)
    adv = torch.where(count > 1, (count * r - total) / (count - 1).clamp(min=1), r)  # (N,)
    return torch.where(loss_mask, adv.unsqueeze(1), 0.0)


@torch.no_grad()
def reinforce_pp_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float,
                            reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(whitened discounted returns, returns) over agent tokens, both (N, T); see the module
    docstring. `reduce` (data parallelism) makes the whitening global."""
    zeros = torch.zeros_like(rewards, dtype=rewards.dtype if rewards.is_floating_point()
                             else torch.float32)
    returns, _ = gae(rewards, zeros, loss_mask, gamma, 1.0)  # V ≡ 0, λ = 1: discounted return
    return masked_whiten(returns, loss_mask, reduce=reduce), returns


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo_estimator(*, loss_mask, rewards, group_ids, **_):
    _need("rloo", rewards=rewards, group_ids=group_ids)
    adv = rloo_advantages(rewards, group_ids, loss_mask)
    return adv, adv.clone()  # no critic: returns = advantages (as verl)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def _reinforce_pp_estimator(*, loss_mask, rewards, gamma, reduce=None, **_):
    _need("reinforce_pp", rewards=rewards)
    return reinforce_pp_advantages(rewards, loss_mask, gamma, reduce)


@ADVANTAGE_ESTIMATORS.register("tir_optimal_token_baseline")
def _tir_otb_estimator(*, loss_mask, rewards, group_ids, old_log_probs=None, sum_pi_squared=None,
                       rollout_is_weights=None, **_):
    _need("tir_optimal_token_baseline", rewards=rewards, group_ids=group_ids,
          old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared)
    return tir_optimal_token_baseline(rewards, loss_mask, group_ids, old_log_probs,
                                      sum_pi_squared, rollout_is_weights)


def compute_advantages(name: str, *, loss_mask: torch.Tensor, turn_ids=None, rewards=None,
                       values=None, scores=None, group_ids=None, gamma: float = 1.0,
                       gae_lambda: float = 1.0, eps: float = 1e-6, norm_by_std: bool = True,
                       whiten: bool = True, reduce=None, old_log_probs=None, sum_pi_squared=None,
                       rollout_is_weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to ADVANTAGE_ESTIMATORS[name]; GAE-based ones whiten over agent tokens when
    `whiten` (docs/design.md §2), over every shard's when `reduce` is given; the estimators of
    OLD_POLICY_ESTIMATORS read `old_log_probs`, `sum_pi_squared` and `rollout_is_weights`.
    Returns (advantages, returns), (N, T)."""
    fn = ADVANTAGE_ESTIMATORS[name]
    return fn(loss_mask=loss_mask, turn_ids=turn_ids, rewards=rewards, values=values,
              scores=scores, group_ids=group_ids, gamma=gamma, gae_lambda=gae_lambda, eps=eps,
              norm_by_std=norm_by_std, whiten=whiten, reduce=reduce, old_log_probs=old_log_probs,
              sum_pi_squared=sum_pi_squared, rollout_is_weights=rollout_is_weights)
