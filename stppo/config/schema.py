"""The run's config schema: one validated dataclass per Hydra group (`Config` holds them all;
the `algo` group's is `stppo.config.algo`). Each default lives here, once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from stppo.alarms import AlarmConfig
from stppo.config.algo import AlgoConfig
from stppo.config.checks import one_of, require
from stppo.diagnostics import CollapseConfig


@dataclass
class ModelConfig:
    name: str = MISSING  # preset name (stppo.models presets)
    path: Optional[str] = None  # local directory or hub id overriding the preset's source
    vocab_size: int = 1500  # random-init presets: size of the locally trained BPE
    # Mixed precision (stppo.models.precision): `dtype` is the compute dtype of forward/backward
    # (autocast; auto = bfloat16 on CUDA that supports it, float32 on CPU; native_bf16 = bfloat16
    # wherever the device computes it natively, a CPU with AVX-512-BF16 or AMX too); `param_dtype`
    # the dtype of parameters and optimizer state (auto = float32 master weights; bfloat16 only on
    # request).
    dtype: str = "auto"  # auto | native_bf16 | float32 | bfloat16
    param_dtype: str = "auto"  # auto | float32 | bfloat16
    gradient_checkpointing: bool = False
    # LM-head positions per chunk of the log-prob/entropy pass (stppo.models.logprobs): the
    # float32 logits of one chunk exist at a time, in backward too. null: as many as fit 256 MiB.
    logits_chunk: Optional[int] = None
    critic_init: str = "policy"  # policy: critic backbone starts from the warm-started policy
    # Random-init presets: Qwen2Config fields over the preset's architecture, e.g.
    # {num_hidden_layers: 2} for a truncated copy of a size preset (tests, quick checks).
    arch_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from stppo.models import MODEL_PRESETS

        one_of("model.name", self.name, tuple(MODEL_PRESETS))
        one_of("model.dtype", self.dtype, ("auto", "native_bf16", "float32", "bfloat16"))
        one_of("model.param_dtype", self.param_dtype, ("auto", "float32", "bfloat16"))
        one_of("model.critic_init", self.critic_init, ("policy", "random"))
        require(self.vocab_size >= 300, f"model.vocab_size must be >= 300, got {self.vocab_size}")
        require(self.logits_chunk is None or self.logits_chunk >= 1,
               f"model.logits_chunk must be null (auto) or >= 1, got {self.logits_chunk}")
        require(not self.arch_overrides or MODEL_PRESETS[self.name].kind == "random",
               f"model.arch_overrides applies to random-init presets only; {self.name!r} is "
               f"{MODEL_PRESETS[self.name].kind}")


@dataclass
class RetrieverConfig:
    kind: str = "bm25"  # bm25 | http
    url: str = "http://127.0.0.1:8000"
    topk: int = 2
    timeout_s: float = 10.0
    retries: int = 3

    def __post_init__(self) -> None:
        one_of("task.retriever.kind", self.kind, ("bm25", "http"))
        require(self.topk >= 1, f"task.retriever.topk must be >= 1, got {self.topk}")


@dataclass
class TaskConfig:
    name: str = MISSING  # testbed | synthetic_multihop | search_r1 | hf | mcq
    prompt_style: str = "compact"  # compact | search_r1 | chat | instruct (stppo.envs.prompts)
    max_turns: int = 4
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    # the task builder's own settings; at start, the values that run. A synthetic world's are
    # stppo.envs.SyntheticConfig's fields: its schema in the ConfigStore (`world/synthetic`), which
    # the synthetic task files put here, so its defaults live in that dataclass alone
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from stppo.envs.tasks import resolved_options

        one_of("task.name", self.name, ("testbed", "synthetic_multihop", "search_r1", "hf", "mcq"))
        one_of("task.prompt_style", self.prompt_style, ("compact", "search_r1", "chat", "instruct"))
        require(self.max_turns >= 1, f"task.max_turns must be >= 1, got {self.max_turns}")
        try:
            self.options = resolved_options(self.name, self.options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"task.options: {e}") from None


@dataclass
class RolloutSettings:
    max_new_tokens: int = 24  # per turn
    max_total_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    # The decoding path (stppo.rollout): auto = static on CUDA (fixed-size cache, batch buckets,
    # CUDA graphs; Qwen2/Llama models), eager otherwise; eager; static (also on the CPU, no graphs)
    engine: str = "auto"
    check_every: int = 8  # static: decoding steps between the host's checks for stop tags
    cuda_graphs: bool = True  # static on CUDA: capture each bucket's decoding step as a graph

    def __post_init__(self) -> None:
        one_of("trainer.rollout.engine", self.engine, ("auto", "eager", "static"))
        require(self.check_every >= 1, f"trainer.rollout.check_every must be >= 1, got {self.check_every}")
        require(self.max_new_tokens >= 1, "trainer.rollout.max_new_tokens must be >= 1")
        require(self.temperature > 0, f"trainer.rollout.temperature must be > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"trainer.rollout.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class WarmStartConfig:
    """The SFT warm start on oracle demonstrations (stppo.train.warmstart); a (task, model) pair
    with a recipe of its own takes it from conf/warmstart/TASK_MODEL.yaml."""
    enabled: bool = True
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    error_rate: float = 0.2  # oracle demonstrations with a wrong query/answer
    # multi-hop demonstrations that answer too early, with an intermediate entity (stppo.envs.oracle)
    shortcut_rate: float = 0.0
    warmup_steps: int = 20

    def __post_init__(self) -> None:
        require(0.0 <= self.error_rate < 1.0, f"trainer.warmstart.error_rate must be in [0, 1), got {self.error_rate}")
        require(0.0 <= self.shortcut_rate <= 1.0,
               f"trainer.warmstart.shortcut_rate must be in [0, 1], got {self.shortcut_rate}")
        require(self.steps >= 0 and self.batch_size >= 1, "trainer.warmstart.steps >= 0 and batch_size >= 1")


@dataclass
class CriticWarmStartConfig:
    """Fit the critic to the warm-started policy's Monte-Carlo returns before RL
    (stppo.train.critic_warmstart); GAE presets only."""
    enabled: bool = False
    questions: int = 128  # training questions rolled out (x trainer.group_size samples each)
    steps: int = 200  # AdamW steps of the value loss
    lr: float = 1.0e-3
    batch_size: int = 32  # trajectories per step

    def __post_init__(self) -> None:
        require(self.questions >= 5 and self.steps >= 1 and self.batch_size >= 1 and self.lr > 0,
               "trainer.critic_warmstart: questions >= 5, steps >= 1, batch_size >= 1, lr > 0")


OFFPOLICY_LAG_MODES = ("fixed", "uniform")


@dataclass
class OffPolicyConfig:
    """Stale rollouts (stppo.train.offpolicy, docs/design.md §8): the batch trained at step t is
    sampled by the policy as it was `lag` updates earlier — after step t − 1 − lag, the start for
    the first steps — as an asynchronous pipeline would; π_old stays the current policy.
    `fixed`: every group has that lag; `uniform`: each group draws its own from 0 … lag
    (seeded by (seed, step)), as a pipeline mixes ages. 0 = on-policy (the default)."""
    lag: int = 0
    lag_mode: str = "fixed"  # fixed | uniform

    def __post_init__(self) -> None:
        require(isinstance(self.lag, int) and self.lag >= 0,
               f"trainer.offpolicy.lag must be an integer >= 0, got {self.lag!r}")
        one_of("trainer.offpolicy.lag_mode", self.lag_mode, OFFPOLICY_LAG_MODES)


@dataclass
class TrainerConfig:
    """The CPU default run (`python run.py`: st_ppo on tiny, on the testbed; docs/results/testbed):
    16 questions x 4 samples per step; 2 epochs of 2 minibatches of 32 (4 optimizer steps per
    rollout, mildly off-policy); actor lr 1e-4; 40 steps, live checks every 5 (`collapse`),
    validation on 200 held-out questions every 10. The warm start is the (task, model) recipe of
    conf/warmstart/ where one exists (testbed_tiny: greedy validation 0.26). In the testbed's
    pilot (docs/results/testbed/pilot: this level, ppo and grpo, seeds 0-3) greedy validation
    rose to 0.55-0.71 at step 20 and 0.69-0.78 at step 40."""
    total_steps: int = 40
    questions_per_step: int = 16
    group_size: int = 4  # samples per question (GRPO groups; also used by GAE presets)
    ppo_epochs: int = 2
    critic_warmup: int = 0  # first steps train only the critic (GAE presets), as in verl
    minibatch_size: int = 32  # trajectories per optimizer step
    # Gradient accumulation: forward/backward this many trajectories at a time inside each
    # minibatch (per rank under torchrun), with the whole minibatch's loss and gradient
    # (stppo.train.microbatch); also the row chunk of the no-grad forwards. 0 = whole minibatch.
    micro_batch_size: int = 0
    actor_lr: float = 1e-4
    critic_lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    val_every: int = 10
    val_questions: int = 200
    save_every: int = 20
    resume: bool = False
    stop_on_collapse: bool = False
    exact_clip_bias_every: int = 0  # diagnostics: exact ‖C‖ every k optimizer steps (0 = never)
    threads: int = 0  # torch threads; 0 = all cores
    device: str = "auto"
    out_dir: str = "runs"
    progress: bool = True
    debug_nan_steps: list[int] = field(default_factory=list)  # fault injection: NaN loss at these steps
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    critic_warmstart: CriticWarmStartConfig = field(default_factory=CriticWarmStartConfig)
    offpolicy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    # Early warning (stppo.alarms): the online alarms watched every step, and what an alarm does:
    # none (log `alarm/<indicator>` only), stop (end the run after a last validation), rollback
    # (reload the last checkpoint before the alarm, scale the learning rates by
    # rollback_lr_factor, go on; at most max_rollbacks times).
    alarm: AlarmConfig = field(default_factory=AlarmConfig)
    on_alarm: str = "none"  # none | stop | rollback
    rollback_lr_factor: float = 0.5
    max_rollbacks: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.collapse, dict):  # built from a plain mapping
            self.collapse = CollapseConfig(**self.collapse)
        if isinstance(self.alarm, dict):
            self.alarm = AlarmConfig(**self.alarm)
        if isinstance(self.offpolicy, dict):
            self.offpolicy = OffPolicyConfig(**self.offpolicy)
        one_of("trainer.on_alarm", self.on_alarm, ("none", "stop", "rollback"))
        require(0.0 < self.rollback_lr_factor <= 1.0,
               f"trainer.rollback_lr_factor must be in (0, 1], got {self.rollback_lr_factor}")
        require(self.max_rollbacks >= 0, f"trainer.max_rollbacks must be >= 0, got {self.max_rollbacks}")
        batch = self.questions_per_step * self.group_size
        require(self.total_steps >= 1, f"trainer.total_steps must be >= 1, got {self.total_steps}")
        require(self.questions_per_step >= 1 and self.group_size >= 1,
               "trainer.questions_per_step and trainer.group_size must be >= 1")
        require(self.ppo_epochs >= 1, f"trainer.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        require(1 <= self.minibatch_size <= batch,
               f"trainer.minibatch_size={self.minibatch_size} must be in [1, questions_per_step x "
               f"group_size = {batch}]")
        require(self.micro_batch_size >= 0 and (self.micro_batch_size == 0
                                                or self.minibatch_size % self.micro_batch_size == 0),
               f"trainer.micro_batch_size={self.micro_batch_size} must be 0 (the whole minibatch) "
               f"or divide trainer.minibatch_size={self.minibatch_size}")
        require(self.actor_lr > 0 and self.critic_lr > 0, "trainer.actor_lr and trainer.critic_lr must be > 0")
        require(self.max_grad_norm > 0, f"trainer.max_grad_norm must be > 0, got {self.max_grad_norm}")
        require(self.val_every >= 0 and self.save_every >= 0, "trainer.val_every and trainer.save_every must be >= 0")
        one_of("trainer.device", self.device, ("auto", "cpu", "cuda"))


@dataclass
class DiagnosticsConfig:
    """What the trainer records beyond the step scalars (docs/design.md §4)."""
    samples_every: int = 10  # sampled trajectories as an MLflow table every k steps (0 = never)
    samples_count: int = 4  # M trajectories per table (one per question)
    per_turn: bool = True  # turn/k{k}/* metrics (clip fraction, ratios, advantage, KL, entropy)

    def __post_init__(self) -> None:
        require(self.samples_every >= 0 and self.samples_count >= 0,
               "diagnostics.samples_every and diagnostics.samples_count must be >= 0")


@dataclass
class TrackingConfig:
    uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str = "stppo"  # one MLflow experiment per study
    run_name: Optional[str] = None
    sweep: str = ""  # sweep name tag ('' outside sweeps)
    enabled: bool = True
    buffer_dir: str = ".stppo_buffer"  # metrics kept here while the server is unreachable
    tags: dict[str, str] = field(default_factory=dict)  # extra run tags (sweeps: study, trial)


BACKENDS = ("own", "verl")
ROLLOUT_ENGINES = ("vllm", "sglang")


@dataclass
class BackendConfig:
    """Which engine trains: stppo's own trainer (`own`) or verl in a subprocess (`verl`,
    `stppo.integrations.verl`). The other fields are read by the verl backend only."""

    name: str = "own"  # own | verl
    python: str = ".venv-verl/bin/python"  # interpreter of the verl environment
    entry: str = "verl.trainer.main_ppo"  # module run as `python -m ENTRY OVERRIDES...`
    dry_run: bool = False  # print the verl command and exit 0
    nnodes: int = 1
    n_gpus_per_node: int = 8
    rollout_engine: str = "vllm"  # vllm | sglang
    rollout_tp: int = 1  # tensor parallel size of the rollout engine
    # trainer.offpolicy.lag > 0: verl's off-policy trainers run the rollout on GPUs of its own;
    # this many of each node's n_gpus_per_node (the rest train). null: half of them.
    rollout_gpus_per_node: Optional[int] = None
    gpu_memory_utilization: float = 0.5  # the rollout engine's share of GPU memory
    micro_batch_size_per_gpu: int = 8  # forward/backward micro-batch (trajectories per GPU)
    # tokens of verl's initial prompt (data.max_prompt_length); the response gets
    # trainer.rollout.max_total_tokens minus this. None: half of that total, at most 512
    # (stppo.integrations.verl.overrides.verl_lengths)
    max_prompt_length: Optional[int] = None
    data_dir: Optional[str] = None  # converted parquet files; None: the stppo cache
    poll_s: float = 10.0  # how often the run's metrics are read while verl trains
    stop_grace_s: float = 60.0  # SIGTERM → SIGKILL delay when verl is stopped
    overrides: list[str] = field(default_factory=list)  # extra verl overrides, appended last

    def __post_init__(self) -> None:
        one_of("backend.name", self.name, BACKENDS)
        one_of("backend.rollout_engine", self.rollout_engine, ROLLOUT_ENGINES)
        require(self.nnodes >= 1 and self.n_gpus_per_node >= 1,
               f"backend.nnodes and backend.n_gpus_per_node must be >= 1, got {self.nnodes}, {self.n_gpus_per_node}")
        require(self.rollout_tp >= 1 and self.n_gpus_per_node % self.rollout_tp == 0,
               f"backend.rollout_tp={self.rollout_tp} must divide backend.n_gpus_per_node={self.n_gpus_per_node}")
        require(self.rollout_gpus_per_node is None
               or 1 <= self.rollout_gpus_per_node < self.n_gpus_per_node,
               f"backend.rollout_gpus_per_node={self.rollout_gpus_per_node} must be null or in [1, "
               f"backend.n_gpus_per_node={self.n_gpus_per_node}) (the rest train)")
        require(0.0 < self.gpu_memory_utilization <= 1.0,
               f"backend.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        require(self.micro_batch_size_per_gpu >= 1, "backend.micro_batch_size_per_gpu must be >= 1")
        require(self.max_prompt_length is None or self.max_prompt_length >= 16,
               f"backend.max_prompt_length must be null or >= 16, got {self.max_prompt_length}")
        require(self.poll_s > 0 and self.stop_grace_s >= 0, "backend.poll_s must be > 0 and backend.stop_grace_s >= 0")
        require(all(isinstance(o, str) and "=" in o for o in self.overrides),
               f"backend.overrides must be verl overrides KEY=VALUE, got {list(self.overrides)}")


@dataclass
class Config:
    algo: AlgoConfig = MISSING
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        _check_baselines(self)
        _check_on_alarm(self)


def _check_baselines(cfg: "Config") -> None:
    """Settings of the baselines that span groups (algo and trainer)."""
    if not isinstance(cfg.algo, AlgoConfig) or not isinstance(cfg.trainer, TrainerConfig):
        return  # MISSING while OmegaConf builds the schema
    a, t = cfg.algo, cfg.trainer  # (dynamic sampling keeps groups of one: a no-op at group_size 1)
    if a.overlong.enabled:
        require(a.overlong.buffer_len <= t.rollout.max_total_tokens,
               f"algo.overlong.buffer_len={a.overlong.buffer_len} must be <= "
               f"trainer.rollout.max_total_tokens={t.rollout.max_total_tokens}")


def _check_on_alarm(cfg: "Config") -> None:
    """trainer.on_alarm=rollback: the own trainer only (verl cannot reload a checkpoint mid-run),
    with checkpoints to roll back to."""
    if not isinstance(cfg.trainer, TrainerConfig) or cfg.trainer.on_alarm != "rollback":
        return
    require(not isinstance(cfg.backend, BackendConfig) or cfg.backend.name != "verl",
           "trainer.on_alarm=rollback: verl has no rollback (it cannot reload a checkpoint mid-run); with "
           "backend=verl use trainer.on_alarm=stop (stop verl at the first alarm) or none")
    require(cfg.trainer.save_every > 0,
           "trainer.on_alarm=rollback needs checkpoints to roll back to: set trainer.save_every > 0")
