"""Build what a run needs from its config: task, environment, tokenizer, the warm-started
policy, the critic and the reference model."""

from __future__ import annotations

import copy
import fcntl
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from stppo.cache import content_hash
from stppo.config import Config
from stppo.envs import SearchEnv, Task, build_retriever, build_task, run_oracle, tokenizer_texts
from stppo.envs.prompts import CHAT_STYLES
from stppo.models import (MODEL_PRESETS, Precision, ValueModel, load_model, reference_model,
                          resolve_precision)
from stppo.algos.modes import LOSS_MODES
from stppo.train import sft
from stppo.train.prepare import set_subsentence_ends, subsentence_end_table

log = logging.getLogger(__name__)
WARMSTART_SEED = 0  # one warm start per (model, task, settings), shared by every seed and preset
SFT_EPISODES_PER_QUESTION = 4  # oracle replays per warm-start question (errors differ per replay)


@dataclass
class Components:
    task: Task
    env: SearchEnv
    tokenizer: Any
    policy: torch.nn.Module
    critic: ValueModel | None
    ref: torch.nn.Module | None
    warmstart_loss: float | None
    precision: Precision = Precision()  # params float32, compute under autocast when mixed
    critic_warmstart: dict = field(default_factory=dict)  # its metrics, logged at step 0


def device_of(cfg: Config) -> torch.device:
    """trainer.device; 'auto' is CUDA when present, else CPU. A CUDA device is this process's GPU
    (LOCAL_RANK under torchrun, else 0). ValueError (one line) when 'cuda' is asked for on a
    machine without one, or when LOCAL_RANK names a GPU that is not there."""
    choice = cfg.trainer.device
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"trainer.device=cuda but torch {torch.__version__} sees no CUDA device "
                         f"(torch.cuda.is_available() is False); use trainer.device=auto or cpu")
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        raise ValueError(f"LOCAL_RANK={local} but this machine has {count} CUDA device(s); "
                         f"start at most {count} processes per node (torchrun --nproc_per_node)")
    return torch.device("cuda", local)


def build_env(cfg: Config, task: Task, tokenizer=None) -> SearchEnv:
    r = cfg.task.retriever
    opts = {"url": r.url, "timeout_s": r.timeout_s, "retries": r.retries} if r.kind == "http" else {}
    retriever = build_retriever(r.kind, corpus=task.corpus, **opts)
    return SearchEnv.for_task(task, retriever, max_turns=cfg.task.max_turns, topk=r.topk,
                              prompt_style=cfg.task.prompt_style, tokenizer=tokenizer)


def build_components(cfg: Config, *, progress: bool = True) -> Components:
    task = build_task(cfg.task.name, **dict(cfg.task.options))
    device = device_of(cfg)
    precision = resolve_precision(cfg.model.dtype, cfg.model.param_dtype, device)
    preset = MODEL_PRESETS[cfg.model.name]
    source = cfg.model.path or cfg.model.name
    env = build_env(cfg, task)
    texts = list(tokenizer_texts(task, env)) if preset.kind == "random" and not cfg.model.path else None
    policy, tokenizer = load_model(source, texts=texts, vocab_size=cfg.model.vocab_size,
                                   seed=WARMSTART_SEED, dtype=precision.param_dtype, device=device,
                                   gradient_checkpointing=cfg.model.gradient_checkpointing,
                                   logits_chunk=cfg.model.logits_chunk,
                                   arch_overrides=dict(cfg.model.arch_overrides))
    if cfg.task.prompt_style in CHAT_STYLES:  # the prompts need the model's chat template
        env = build_env(cfg, task, tokenizer)
    ws_loss = warm_start(cfg, task, env, policy, tokenizer, progress=progress, precision=precision)
    critic = None
    if cfg.algo.use_critic:
        critic = ValueModel.from_policy(policy, init_from_policy=cfg.model.critic_init == "policy")
        if cfg.model.gradient_checkpointing:
            critic.gradient_checkpointing_enable()
    # The frozen reference is held in the compute dtype (half the memory under bf16 autocast).
    ref = (reference_model(policy, precision.compute_dtype if precision.mixed else None)
           if cfg.algo.kl.coef > 0 else None)
    if LOSS_MODES[cfg.algo.spec.runs].segments:  # SSPO: the ids that end a subsentence
        set_subsentence_ends(policy, subsentence_end_table(
            tokenizer, cfg.algo.subsentence_delimiters, policy.get_input_embeddings().num_embeddings))
    comps = Components(task, env, tokenizer, policy, critic, ref, ws_loss, precision)
    if critic is not None and cfg.trainer.critic_warmstart.enabled:
        from stppo.train.critic_warmstart import critic_warm_start

        comps.critic_warmstart = critic_warm_start(cfg, comps)
    return comps


def warm_start(cfg: Config, task: Task, env: SearchEnv, policy, tokenizer, *,
               progress: bool = True, precision: Precision = Precision()) -> float | None:
    """SFT the policy on oracle episodes of the task's 'sft' split, through the cache."""
    ws = cfg.trainer.warmstart
    if not ws.enabled or ws.steps == 0:
        return None
    if getattr(task, "world", None) is None:
        raise ValueError(f"trainer.warmstart needs an oracle, which task {cfg.task.name!r} lacks; "
                         "set trainer.warmstart.enabled=false (pretrained models) or use "
                         "task=testbed or task=synthetic_multihop")
    key = {"model": asdict(cfg.model), "task": asdict(cfg.task), "warmstart": asdict(ws),
           "tokenizer": content_hash(tokenizer.get_vocab()), "version": 1}
    path = sft.warmstart_dir(key)
    # Parallel jobs of a study share this entry: the first one trains it under an exclusive lock,
    # the others wait and load it; files are written whole (tmp + rename) and DONE comes last.
    with open(path / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / sft.DONE).exists():
            policy.load_state_dict(torch.load(path / "policy.pt", map_location="cpu"))
            log.info("warm start: reused %s", path)
            return float((path / sft.DONE).read_text() or "nan")
        questions = task.split("sft")
        episodes = []
        for rep in range(SFT_EPISODES_PER_QUESTION):
            episodes += run_oracle(env, task, questions, error_rate=ws.error_rate,
                                   seed=WARMSTART_SEED + rep, shortcut_rate=ws.shortcut_rate)
        losses = sft.train_sft(policy, tokenizer, episodes, ws, seed=WARMSTART_SEED,
                               progress=progress, precision=precision)
        final = sum(losses[-20:]) / max(1, len(losses[-20:]))
        torch.save(copy.deepcopy(policy.state_dict()), path / "policy.pt.tmp")
        os.replace(path / "policy.pt.tmp", path / "policy.pt")
        (path / sft.DONE).write_text(f"{final:.6f}")
        return final
