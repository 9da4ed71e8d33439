"""verl's own actor update with stppo's losses: the worker, the batch and the reference forward
used by `test_verl_actor_update.py` (CPU in CI; CUDA from scripts/gpu_check_verl.sh).

The worker is `verl.workers.engine_workers.ActorRolloutRefWorker(config=cfg.actor_rollout_ref,
role="actor")`, `cfg` verl's own `ppo_trainer` composed with the overrides stppo's launcher
translates (`stppo.integrations.verl.overrides.verl_overrides`) plus what this check fixes:
the model folder (a random-init Qwen2 of hidden 64, 2 layers; `local_model.make_random_model`),
FSDP2 and sdpa attention, and on the CPU float32 (no mixed precision) without torch.compile.
On CUDA verl's defaults stay: bf16 FSDP2 mixed precision over float32 master weights.
Batches are laid out as verl's trainer hands them to the actor: left-padded prompts,
right-padded responses, `response_mask` 0 on observation runs inside the response.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DEVICE = os.environ.get("STPPO_TEST_DEVICE", "cpu")  # cpu | cuda
PAPER_PRESETS = ("ppo", "turn_ppo", "s_ppo", "st_ppo", "so_ppo", "grpo", "gspo", "so_grpo")
CPU_PRESETS = ("ppo", "st_ppo", "so_grpo", "cispo")  # two of the paper's, one group preset, a baseline
ACTOR = "actor_rollout_ref.actor"
# stppo's side of the job: 8 questions × 2 samples = 16 rows, mini-batches of 8 rows (verl:
# ppo_mini_batch_size 4 prompts × rollout.n 2), micro-batches of 4 rows — 2 optimizer steps of
# 2 micro-batches each.
STPPO_SETTINGS = ("backend=verl", "model=qwen2_5_0_5b", "trainer.questions_per_step=8", "trainer.group_size=2",
                  "trainer.minibatch_size=8", "backend.micro_batch_size_per_gpu=4", "trainer.actor_lr=1e-4",
                  "trainer.rollout.max_total_tokens=1024")
PROMPT_LEN, RESPONSE_LEN = 6, 24


def init_process_group() -> None:
    """One rank: gloo on the CPU (with the test-only CPU platform); on CUDA verl's own
    `initialize_global_process_group_ray` (cpu:gloo,cuda:nccl), as its TrainingWorker calls it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:  # verl's Worker records the master's address; only CUDA binds it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if DEVICE == "cpu":
        from cpu_platform import use_cpu_platform

        use_cpu_platform()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port bound
    else:
        from verl.utils.distributed import initialize_global_process_group_ray

        torch.cuda.set_device(0)
        initialize_global_process_group_ray()


def verl_config(preset: str, model_dir: Path, loss_mode: str | None = None, extra: tuple = ()):
    """verl's `ppo_trainer` config with stppo's overrides for `algo=preset` (`loss_mode` replaces
    stppo_<preset>, e.g. verl's 'vanilla'; `extra`: more stppo overrides, e.g. a search path)."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from stppo.config import compose, to_config
    from stppo.integrations.verl import overrides as O

    cfg = to_config(compose([*STPPO_SETTINGS, *extra, f"algo={preset}"]))
    files = O.JobFiles("/data/train.parquet", "/data/val.parquet", "/data/tool_config.yaml", "/ckpt")
    ov = [o.split("=", 1)[0] + f"={model_dir}" if o.split("=", 1)[0].endswith("model.path") else o
          for o in O.verl_overrides(cfg, files)]
    ov += [f"{ACTOR}.strategy=fsdp2", "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]
    if DEVICE == "cpu":  # float32 throughout; inductor would need a C++ toolchain for the entropy
        ov += [f"+{ACTOR}.fsdp_config.mixed_precision={{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}}",
               f"{ACTOR}.fsdp_config.use_torch_compile=false"]
    if loss_mode:
        ov.append(f"{ACTOR}.policy_loss.loss_mode={loss_mode}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"),
                               version_base=None):
        return hydra_compose("ppo_trainer", overrides=ov), cfg


def build_worker(verl_cfg):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(config=verl_cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


@dataclass
class Batch:
    """A mini-batch as verl's trainer holds it (N rows; P prompt, T response positions)."""

    prompts: torch.Tensor  # (N, P) left-padded ids
    responses: torch.Tensor  # (N, T) right-padded ids
    attention_mask: torch.Tensor  # (N, P + T)
    response_mask: torch.Tensor  # (N, T) 1 on generated tokens, 0 on observations and padding

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.responses], dim=1)  # (N, P + T)

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (N, P + T)

    @property
    def response_attention(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompts.shape[1]:]  # (N, T) every real response token


def make_batch(rows: int, vocab: int, pad_id: int, seed: int = 0) -> Batch:
    """Rows of 1–4 turns separated by observation runs (`verl_batch._row_layout`), one cut
    mid-turn by the response limit, one with no agent token; prompts of 2–P tokens."""
    from verl_batch import _row_layout

    gen = torch.Generator().manual_seed(seed)
    kinds = ["turns"] * rows
    kinds[1], kinds[rows - 2] = "truncated", "empty"
    masks, lengths = zip(*(_row_layout(gen, RESPONSE_LEN, k) for k in kinds))
    prompt_len = torch.randint(2, PROMPT_LEN + 1, (rows,), generator=gen)  # (N,)
    prompt_att = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - prompt_len[:, None]).long()  # (N, P) left padding
    resp_att = (torch.arange(RESPONSE_LEN) < torch.tensor(lengths)[:, None]).long()  # (N, T) right padding

    def ids(att: torch.Tensor) -> torch.Tensor:
        return torch.where(att.bool(), torch.randint(3, vocab, att.shape, generator=gen), pad_id)

    return Batch(ids(prompt_att), ids(resp_att), torch.cat([prompt_att, resp_att], dim=1),
                 torch.tensor(masks, dtype=torch.long))


def _packed(b: Batch, **extra: torch.Tensor):
    """The trainer's step 2: the padded batch as a tensordict, then verl's no-padding layout."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = tu.get_tensordict({"prompts": b.prompts, "responses": b.responses, "input_ids": b.input_ids,
                            "attention_mask": b.attention_mask, "position_ids": b.position_ids,
                            "response_mask": b.response_mask, **extra}, non_tensor_dict={"temperature": 1.0})
    return left_right_2_no_padding(td)


def compute_log_prob(worker, b: Batch) -> torch.Tensor:
    """(N, T) float32 log π of the responses, as `RayPPOTrainer._compute_old_log_prob` gets them."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    td = _packed(b)
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    out = worker.compute_log_prob(td)
    return no_padding_2_padding(tu.get(out, "log_probs"), td).float()


def update_actor(worker, b: Batch, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                 mini_batch_rows: int) -> tuple[dict, float]:
    """(the worker's metrics, seconds) of `update_actor`, called as `RayPPOTrainer._update_actor`."""
    from verl.utils import tensordict_utils as tu

    td = _packed(b, old_log_probs=old_log_probs, advantages=advantages)
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mini_batch_rows, mini_batch_size=mini_batch_rows, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    _sync()
    start = time.perf_counter()
    out = worker.update_actor(td)
    _sync()
    return tu.get(out, "metrics"), time.perf_counter() - start


def as_logged(metrics: dict) -> dict[str, float]:
    """What verl's trainer logs of the worker's metrics (`_update_actor`, then `reduce_metrics`)."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    out = rename_dict(dict(metrics), "actor/")
    out["perf/mfu/actor"] = out.pop("actor/mfu")
    return {k: float(v) for k, v in reduce_metrics(out).items()}


def weights(worker) -> dict[str, torch.Tensor]:
    """The actor's full parameters (FSDP2 DTensors gathered), copied to the CPU."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for n, p in worker.actor.engine.module.named_parameters()}


def reference_log_probs(model_dir: Path, b: Batch) -> torch.Tensor:
    """(N, T) log π of the responses from a plain transformers forward over the padded batch, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                       position_ids=b.position_ids).logits[:, b.prompts.shape[1] - 1:-1]  # (N, T, V)
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, b.responses[..., None])[..., 0]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
