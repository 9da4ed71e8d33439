"""How far verl's per-micro-batch λ is from the mini-batch's λ (docs/design.md §6).

Under verl a policy loss sees one micro-batch of one rank, so the corrections of S-PPO / ST-PPO
(λ = 1/max(1, ‖C‖/τ)) and SO-PPO (λ = 1/r when r > τ) are computed per micro-batch. This script
builds an off-policy mini-batch laid out like a multi-turn search agent's, calls the registered
`stppo_<preset>` loss exactly as verl's `ppo_loss` does (verl's global counts in
`config.global_batch_info`), once on the whole mini-batch and once per micro-batch, and prints

    λ_mini, the micro-batch λ_m (mean, min, max), mean |λ_m − λ_mini| / λ_mini,
    ‖g_verl − g_mini‖ / ‖g_mini‖ and ⟨g_verl, g_mini⟩ / ‖g_mini‖²

with g = ∂loss/∂log π: g_mini of the mini-batch loss with its own λ, g_verl = Σ_m of the
micro-batch losses (what verl accumulates). Data: synthetic (no model), seeded; the figures
depend on it. Run: `PYTHONPATH=$PWD .venv-verl/bin/python scripts/verl_lambda_gap.py`.
"""

from __future__ import annotations

import argparse

import torch

N_ROWS, T = 64, 1024  # a mini-batch of 16 questions × 4 rollouts; response_length 1024
PRESETS = ("s_ppo", "st_ppo", "so_ppo")


def search_agent_batch(seed: int, turn_sd: float, tok_sd: float) -> dict[str, torch.Tensor]:
    """Rows of 2–5 assistant turns (30–150 tokens) separated by retrieved documents (100–300
    masked tokens), some cut at T. log π − log π_old = a per-turn drift N(0, turn_sd²) plus a
    heavy-tailed token term tok_sd·t₅ (stale low-probability tokens); advantages: a per-row
    outcome term ±1 plus per-token noise 0.3, whitened over agent tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(N_ROWS, T, dtype=torch.bool)
    drift = torch.zeros(N_ROWS, T, dtype=torch.float64)
    for i in range(N_ROWS):
        t = 0
        for k in range(int(torch.randint(2, 6, (1,), generator=g))):
            if k:
                t += int(torch.randint(100, 301, (1,), generator=g))
            n = int(torch.randint(30, 151, (1,), generator=g))
            mask[i, t:t + n] = True
            drift[i, t:t + n] = float(torch.randn(1, generator=g, dtype=torch.float64)) * turn_sd
            t += n
            if t >= T:
                break
    old = -torch.rand(N_ROWS, T, generator=g, dtype=torch.float64) * 2.0
    z = torch.randn(6, N_ROWS, T, generator=g, dtype=torch.float64)
    t5 = z[0] / (z[1:].square().mean(0)).sqrt()  # Student t, 5 degrees of freedom
    lp = old + drift + tok_sd * t5
    outcome = torch.where(torch.rand(N_ROWS, 1, generator=g) < 0.5, 1.0, -1.0).double()
    adv = outcome + 0.3 * torch.randn(N_ROWS, T, generator=g, dtype=torch.float64)
    a = adv[mask]
    adv = torch.where(mask, (adv - a.mean()) / a.std(), 0.0)
    perm = torch.randperm(N_ROWS, generator=g)  # verl splits the (shuffled) mini-batch in order
    return {"log_prob": lp[perm], "old_log_prob": old[perm], "advantages": adv[perm],
            "response_mask": mask[perm]}


def actor_config(preset: str, micro: int, tau):
    from verl.workers.config import FSDPActorConfig

    from stppo.integrations.verl.config import StppoPolicyLossConfig

    return FSDPActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=micro,
                           loss_agg_mode="seq-mean-token-mean",
                           policy_loss=StppoPolicyLossConfig(loss_mode=f"stppo_{preset}",
                                                             tau=tau))


def losses(preset: str, batch: dict, micro: int, tau) -> tuple[list[float], torch.Tensor]:
    """verl's calls over micro-batches of `micro` rows: (λ per micro-batch, ∂Σ loss/∂log π)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    cfg = actor_config(preset, micro, tau)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(batch["response_mask"].sum()),
                                 global_batch_size=N_ROWS, loss_scale_factor=None)
    fn = get_policy_loss_fn(f"stppo_{preset}")
    lp = batch["log_prob"].clone().requires_grad_(True)
    lams = []
    for s in range(0, N_ROWS, micro):
        rows = slice(s, s + micro)
        loss, metrics = fn(old_log_prob=batch["old_log_prob"][rows], log_prob=lp[rows],
                           advantages=batch["advantages"][rows],
                           response_mask=batch["response_mask"][rows],
                           loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=None)
        loss.backward()
        lams.append(metrics["clip_bias/scale"])
    return lams, lp.grad


def gap(preset: str, tau, m: int, level: tuple[float, float], seeds: int) -> list[float]:
    """The printed figures for one setting, averaged over `seeds` batches."""
    rows = []
    for seed in range(seeds):
        batch = search_agent_batch(seed, *level)
        (lam,), g = losses(preset, batch, N_ROWS, tau)
        lams, g_v = losses(preset, batch, N_ROWS // m, tau)
        lt = torch.tensor(lams, dtype=torch.float64)
        rows.append([lam, float(lt.mean()), float(lt.min()), float(lt.max()),
                     float((lt - lam).abs().mean() / lam), float((g_v - g).norm() / g.norm()),
                     float((g_v * g).sum() / g.square().sum())])
    return torch.tensor(rows).mean(0).tolist()


LEVELS = {"mild": (0.05, 0.05), "medium": (0.1, 0.15), "strong": (0.2, 0.3)}
TAUS = {"s_ppo": (None, 0.2), "st_ppo": (None, 0.2), "so_ppo": (None, 1.0)}  # default, lower


def main() -> None:
    import verl  # noqa: F401 — registers the stppo_* losses through the entry point

    from stppo.algos import PRESETS as STPPO_PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"mini-batch {N_ROWS} rows x T={T}, seq-mean-token-mean; M micro-batches of {N_ROWS}/M "
          f"rows; means over {args.seeds} seeded batches")
    print("off-policy preset    tau  M  lam_mini  lam_m mean [min, max]  |dlam|/lam  "
          "|dg|/|g|  <g_v,g>/|g|^2")
    for label, level in LEVELS.items():
        for preset in PRESETS:
            for tau in TAUS[preset]:
                t = STPPO_PRESETS[preset].tau if tau is None else tau
                for m in (2, 4, 8):
                    r = gap(preset, tau, m, level, args.seeds)
                    print(f"{label:10s} {preset:7s} {t:4.2f} {m:2d}  {r[0]:.3f}     {r[1]:.3f} "
                          f"[{r[2]:.3f}, {r[3]:.3f}]   {r[4]:.3f}       {r[5]:.3f}     {r[6]:.3f}")


if __name__ == "__main__":
    main()
