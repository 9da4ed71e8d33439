"""Config schemas: one validated dataclass per Hydra group.

Hydra composes YAML from `conf/` over these schemas (type-checked by OmegaConf); `to_config`
then builds the dataclasses, whose `__post_init__` rejects invalid settings with one line that
names the field and the allowed values. Nothing mutates a config after that.
Every default lives here, once: the default group files of `conf/` (trainer/default,
tracking/mlflow, backend/own) set nothing, and `conf/` holds only what differs from these
defaults (a preset, a model, a world, a study; tests/test_config_source.py checks both).
Torch-free: importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from stppo.alarms import AlarmConfig
from stppo.diagnostics import CollapseConfig

KL_ESTIMATORS = ("k1", "k2", "k3")


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid; allowed: {', '.join(map(str, allowed))}")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# SSPO's subsentence ends (stppo.train.prepare): sentence and clause punctuation, and newline
# (written as backslash + n, also on the command line: algo.subsentence_delimiters='.,;:!?\n').
DEFAULT_SUBSENTENCE_DELIMITERS = ".,;:!?\\n"


def delimiter_chars(delimiters: str) -> str:
    """The characters of `algo.subsentence_delimiters`, `\\n` read as a newline."""
    return delimiters.replace("\\n", "\n")


@dataclass
class ClipBiasConfig:
    """The clip-bias scale λ of the loss (S-, ST-, SO-PPO; stppo.algos.clip_bias); null fields:
    the preset's."""
    kind: Optional[str] = None  # none | clip_bias_norm | clip_triggered
    tau: Optional[float] = None  # None: the preset's, else the kind's default (DEFAULT_TAU)
    estimator: str = "token"  # token | grad
    granularity: str = "batch"  # batch | sequence


@dataclass
class KLConfig:
    coef: float = 0.0  # β; 0 disables the reference model entirely
    estimator: str = "k3"
    in_reward: bool = False  # True: per-token penalty in the reward; False: a loss term

    def __post_init__(self) -> None:
        _one_of("algo.kl.estimator", self.estimator, KL_ESTIMATORS)
        _check(self.coef >= 0, f"algo.kl.coef must be >= 0, got {self.coef}")


@dataclass
class RolloutCorrectionOptions:
    """The arguments of verl's `RolloutCorrectionConfig` classmethod that `algo.rollout_correction`
    names (docs/design.md §2, "Rollout correction"); null: the classmethod's default. At start the
    name's arguments are filled with the values that ran; one it does not take must stay null."""
    threshold: Optional[float] = None  # IS weights' C (…_is, bypass_pg_is), IcePop's upper bound
    threshold_lower: Optional[float] = None  # IcePop's lower bound (…_icepop)
    is_threshold: Optional[float] = None  # IS weights' C beside rejection (…_rs_*_tis, seq_is_rs)
    # rejection: a number, or 'lower_upper' for the k1 (geo, seq_is_rs) options — write both bounds
    # with a decimal point or quote it: Hydra reads 0.5_2 as the number 0.52
    rs_threshold: Any = None
    batch_normalize: Optional[bool] = None  # IS weights / their batch mean (names with IS weights)


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: drop groups whose rewards all agree, roll out more questions to
    refill the batch (verl's algorithm.filter_groups)."""
    enabled: Optional[bool] = None  # None: the preset's (dapo: on)
    max_rounds: int = 4  # refill rollouts per step at most (verl: max_num_gen_batches − 1)
    refill_factor: float = 2.0  # questions rolled out per missing group (verl's replay buffer: 2)

    def __post_init__(self) -> None:
        _check(self.max_rounds >= 0, f"algo.dynamic_sampling.max_rounds must be >= 0, got "
                                     f"{self.max_rounds}")
        _check(self.refill_factor >= 1, f"algo.dynamic_sampling.refill_factor must be >= 1, got "
                                        f"{self.refill_factor}")


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment on the trajectory score (verl's overlong_buffer); the
    length limit is trainer.rollout.max_total_tokens."""
    enabled: Optional[bool] = None  # None: the preset's (dapo: on)
    buffer_len: int = 128  # L_cache: the penalty ramps over the last buffer_len tokens
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        _check(self.buffer_len >= 1, f"algo.overlong.buffer_len must be >= 1, got {self.buffer_len}")
        _check(self.penalty_factor >= 0, f"algo.overlong.penalty_factor must be >= 0, got "
                                         f"{self.penalty_factor}")


@dataclass
class AlgoConfig:
    """The run's loss: a preset (stppo.algos.PRESETS, named by conf/algo/<name>.yaml) — a built-in
    one or a researcher's, registered by their package (stppo.plugins) — with the run's
    overrides. Loss fields left null take the preset's value; `spec` is the one validated
    `LossSpec` that the trainer, data parallelism and the verl backend read."""
    name: str = MISSING  # preset name
    # the module that registers the preset, for a package that is not installed (a plain folder on
    # hydra.searchpath); installed packages are found by their entry point (stppo.plugins)
    plugin: Optional[str] = None
    ratio_level: Optional[str] = None
    advantage: Optional[str] = None
    use_critic: Optional[bool] = None
    loss_agg: Optional[str] = None
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    dual_clip: Optional[float] = None
    clip_bias: ClipBiasConfig = field(default_factory=ClipBiasConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    gamma: float = 1.0  # discount
    gae_lambda: float = 1.0  # GAE's λ (the clip-bias scale is another λ: clip_bias/scale)
    whiten_advantages: bool = True
    grpo_eps: float = 1e-6
    entropy_coef: float = 0.0
    vf_clip: float = 0.5
    loss_mode: Optional[str] = None  # stppo.algos.LOSS_MODES
    loss_options: dict[str, float] = field(default_factory=dict)  # over the preset's (mode's) options
    # The sampler/trainer mismatch correction, with any preset: none (metrics only) or a verl
    # RolloutCorrectionConfig preset (stppo.algos.rollout_corr.ROLLOUT_CORRECTIONS), its arguments
    # in rollout_correction_options.
    rollout_correction: str = "none"
    rollout_correction_options: RolloutCorrectionOptions = field(default_factory=RolloutCorrectionOptions)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # the characters whose tokens end a subsentence (loss modes that read subsentences: sspo)
    subsentence_delimiters: str = DEFAULT_SUBSENTENCE_DELIMITERS

    def __post_init__(self) -> None:
        for sub, cls in (("clip_bias", ClipBiasConfig), ("kl", KLConfig),
                         ("dynamic_sampling", DynamicSamplingConfig),
                         ("rollout_correction_options", RolloutCorrectionOptions),
                         ("overlong", OverlongConfig)):
            if isinstance(getattr(self, sub), dict):
                setattr(self, sub, cls(**getattr(self, sub)))
        _check(0.0 <= self.gamma <= 1.0 and 0.0 <= self.gae_lambda <= 1.0,
               f"algo.gamma and algo.gae_lambda must be in [0, 1], got {self.gamma}, {self.gae_lambda}")
        _check(self.vf_clip > 0, f"algo.vf_clip must be > 0, got {self.vf_clip}")
        _check(bool(delimiter_chars(str(self.subsentence_delimiters))),
               "algo.subsentence_delimiters must name at least one character, got ''")
        self._spec = resolve_loss(self)

    @property
    def spec(self):
        """The run's `stppo.algos.LossSpec` (validated at construction)."""
        return self._spec


def resolve_loss(a: AlgoConfig):
    """Fill the null loss fields of `a` from its preset (the config then records the values
    that ran) and build its `LossSpec` — the one place a loss setting is validated."""
    from stppo.algos import PRESETS, ClipBias, LossSpec, RolloutCorrection
    from stppo.plugins import import_plugin, load_plugins

    load_plugins()
    if a.plugin is not None:
        import_plugin(a.plugin, f"algo.plugin={a.plugin!r}")
    _one_of("algo.name", a.name, tuple(PRESETS))
    p = PRESETS[a.name]
    base, ds, ov = p.spec(), p.dynamic_sampling, p.overlong
    c = a.clip_bias
    if c.kind is not None:
        from stppo.algos import CLIP_BIAS_KINDS

        _one_of("algo.clip_bias.kind", c.kind, tuple(CLIP_BIAS_KINDS))
    for name in ("ratio_level", "advantage", "use_critic", "loss_agg", "clip_low", "clip_high",
                 "dual_clip", "loss_mode"):
        if getattr(a, name) is None:
            setattr(a, name, getattr(base, name))
    if c.kind is None:
        c.kind = base.clip_bias_kind
    if c.tau is None and c.kind != "none":
        same = base.clip_bias is not None and base.clip_bias.kind == c.kind
        c.tau = base.clip_bias.tau if same else None
    a.loss_options = {**(base.options if a.loss_mode == base.loss_mode else {}), **dict(a.loss_options)}
    if a.dynamic_sampling.enabled is None:
        a.dynamic_sampling.enabled = ds
    if a.overlong.enabled is None:
        a.overlong.enabled = ov
    try:
        clip_bias = ClipBias(c.kind, c.tau, c.estimator, c.granularity)
    except ValueError as e:
        raise ValueError(f"algo.{e}") from None
    c.tau = clip_bias.tau
    spec = LossSpec(name=a.name, ratio_level=a.ratio_level, clip_low=a.clip_low,
                    clip_high=a.clip_high, dual_clip=a.dual_clip, loss_agg=a.loss_agg,
                    clip_bias=clip_bias, loss_mode=a.loss_mode, options=a.loss_options,
                    rollout_correction=RolloutCorrection(a.rollout_correction, {
                        k: v for k, v in asdict(a.rollout_correction_options).items() if v is not None}),
                    advantage=a.advantage, use_critic=a.use_critic)
    a.loss_options = dict(spec.options)
    for k, v in spec.rollout_correction.options.items():  # the values that ran
        setattr(a.rollout_correction_options, k, v)
    return spec


@dataclass
class ModelConfig:
    name: str = MISSING  # preset name (stppo.models presets)
    path: Optional[str] = None  # local directory or hub id overriding the preset's source
    vocab_size: int = 1500  # random-init presets: size of the locally trained BPE
    # Mixed precision (stppo.models.precision): `dtype` is the compute dtype of forward/backward
    # (autocast; auto = bfloat16 on CUDA that supports it, float32 on CPU); `param_dtype` the dtype
    # of parameters and optimizer state (auto = float32 master weights; bfloat16 only on request).
    dtype: str = "auto"  # auto | float32 | bfloat16
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

        _one_of("model.name", self.name, tuple(MODEL_PRESETS))
        _one_of("model.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _one_of("model.param_dtype", self.param_dtype, ("auto", "float32", "bfloat16"))
        _one_of("model.critic_init", self.critic_init, ("policy", "random"))
        _check(self.vocab_size >= 300, f"model.vocab_size must be >= 300, got {self.vocab_size}")
        _check(self.logits_chunk is None or self.logits_chunk >= 1,
               f"model.logits_chunk must be null (auto) or >= 1, got {self.logits_chunk}")
        _check(not self.arch_overrides or MODEL_PRESETS[self.name].kind == "random",
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
        _one_of("task.retriever.kind", self.kind, ("bm25", "http"))
        _check(self.topk >= 1, f"task.retriever.topk must be >= 1, got {self.topk}")


@dataclass
class TaskConfig:
    name: str = MISSING  # testbed | synthetic_multihop | search_r1 | hf | mcq
    prompt_style: str = "compact"  # compact | search_r1 | chat
    max_turns: int = 4
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    options: dict[str, Any] = field(default_factory=dict)  # the task builder's own settings

    def __post_init__(self) -> None:
        _one_of("task.name", self.name, ("testbed", "synthetic_multihop", "search_r1", "hf", "mcq"))
        _one_of("task.prompt_style", self.prompt_style, ("compact", "search_r1", "chat"))
        _check(self.max_turns >= 1, f"task.max_turns must be >= 1, got {self.max_turns}")


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
        _one_of("trainer.rollout.engine", self.engine, ("auto", "eager", "static"))
        _check(self.check_every >= 1, f"trainer.rollout.check_every must be >= 1, got {self.check_every}")
        _check(self.max_new_tokens >= 1, "trainer.rollout.max_new_tokens must be >= 1")
        _check(self.temperature > 0, f"trainer.rollout.temperature must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"trainer.rollout.top_p must be in (0, 1], got {self.top_p}")


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
        _check(0.0 <= self.error_rate < 1.0, f"trainer.warmstart.error_rate must be in [0, 1), got {self.error_rate}")
        _check(0.0 <= self.shortcut_rate <= 1.0,
               f"trainer.warmstart.shortcut_rate must be in [0, 1], got {self.shortcut_rate}")
        _check(self.steps >= 0 and self.batch_size >= 1, "trainer.warmstart.steps >= 0 and batch_size >= 1")


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
        _check(self.questions >= 5 and self.steps >= 1 and self.batch_size >= 1 and self.lr > 0,
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
        _check(isinstance(self.lag, int) and self.lag >= 0,
               f"trainer.offpolicy.lag must be an integer >= 0, got {self.lag!r}")
        _one_of("trainer.offpolicy.lag_mode", self.lag_mode, OFFPOLICY_LAG_MODES)


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
        _one_of("trainer.on_alarm", self.on_alarm, ("none", "stop", "rollback"))
        _check(0.0 < self.rollback_lr_factor <= 1.0,
               f"trainer.rollback_lr_factor must be in (0, 1], got {self.rollback_lr_factor}")
        _check(self.max_rollbacks >= 0, f"trainer.max_rollbacks must be >= 0, got {self.max_rollbacks}")
        batch = self.questions_per_step * self.group_size
        _check(self.total_steps >= 1, f"trainer.total_steps must be >= 1, got {self.total_steps}")
        _check(self.questions_per_step >= 1 and self.group_size >= 1,
               "trainer.questions_per_step and trainer.group_size must be >= 1")
        _check(self.ppo_epochs >= 1, f"trainer.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        _check(1 <= self.minibatch_size <= batch,
               f"trainer.minibatch_size={self.minibatch_size} must be in [1, questions_per_step x "
               f"group_size = {batch}]")
        _check(self.micro_batch_size >= 0 and (self.micro_batch_size == 0
                                                or self.minibatch_size % self.micro_batch_size == 0),
               f"trainer.micro_batch_size={self.micro_batch_size} must be 0 (the whole minibatch) "
               f"or divide trainer.minibatch_size={self.minibatch_size}")
        _check(self.actor_lr > 0 and self.critic_lr > 0, "trainer.actor_lr and trainer.critic_lr must be > 0")
        _check(self.max_grad_norm > 0, f"trainer.max_grad_norm must be > 0, got {self.max_grad_norm}")
        _check(self.val_every >= 0 and self.save_every >= 0, "trainer.val_every and trainer.save_every must be >= 0")
        _one_of("trainer.device", self.device, ("auto", "cpu", "cuda"))


@dataclass
class DiagnosticsConfig:
    """What the trainer records beyond the step scalars (docs/design.md §4)."""
    samples_every: int = 10  # sampled trajectories as an MLflow table every k steps (0 = never)
    samples_count: int = 4  # M trajectories per table (one per question)
    per_turn: bool = True  # turn/k{k}/* metrics (clip fraction, ratios, advantage, KL, entropy)

    def __post_init__(self) -> None:
        _check(self.samples_every >= 0 and self.samples_count >= 0,
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
        _one_of("backend.name", self.name, BACKENDS)
        _one_of("backend.rollout_engine", self.rollout_engine, ROLLOUT_ENGINES)
        _check(self.nnodes >= 1 and self.n_gpus_per_node >= 1,
               f"backend.nnodes and backend.n_gpus_per_node must be >= 1, got {self.nnodes}, {self.n_gpus_per_node}")
        _check(self.rollout_tp >= 1 and self.n_gpus_per_node % self.rollout_tp == 0,
               f"backend.rollout_tp={self.rollout_tp} must divide backend.n_gpus_per_node={self.n_gpus_per_node}")
        _check(self.rollout_gpus_per_node is None
               or 1 <= self.rollout_gpus_per_node < self.n_gpus_per_node,
               f"backend.rollout_gpus_per_node={self.rollout_gpus_per_node} must be null or in [1, "
               f"backend.n_gpus_per_node={self.n_gpus_per_node}) (the rest train)")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"backend.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.micro_batch_size_per_gpu >= 1, "backend.micro_batch_size_per_gpu must be >= 1")
        _check(self.max_prompt_length is None or self.max_prompt_length >= 16,
               f"backend.max_prompt_length must be null or >= 16, got {self.max_prompt_length}")
        _check(self.poll_s > 0 and self.stop_grace_s >= 0, "backend.poll_s must be > 0 and backend.stop_grace_s >= 0")
        _check(all(isinstance(o, str) and "=" in o for o in self.overrides),
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


# Settings that do not change what a run computes, left out of its identity: how it resumes and
# shows progress, where it is tracked; the verl launcher's own process knobs.
_NOT_IDENTITY = {"trainer": ("resume", "progress"),
                 "backend_verl": ("dry_run", "poll_s", "stop_grace_s", "python")}


def run_identity(cfg: "Config") -> str:
    """The name of a run's job folder (`trainer.out_dir/<experiment>/<name>`: its checkpoints),
    for both backends: `<algo>-<model>-<task>-seed<seed>[-verl]-<hash of its settings>`. Same
    settings ⇒ same name, so a resumed run finds its checkpoints. Settings added with a default
    that changes nothing (on-policy `trainer.offpolicy`, verl's unset `rollout_gpus_per_node`)
    are left out, so earlier runs keep their folders."""
    from stppo.cache import content_hash

    d = asdict(cfg)
    for k in _NOT_IDENTITY["trainer"]:
        d["trainer"].pop(k)
    d.pop("tracking")
    if d["trainer"]["offpolicy"] == asdict(OffPolicyConfig()):
        d["trainer"].pop("offpolicy")
    tag = ""
    if cfg.backend.name == "verl":
        for k in _NOT_IDENTITY["backend_verl"]:
            d["backend"].pop(k)
        if d["backend"]["rollout_gpus_per_node"] is None:
            d["backend"].pop("rollout_gpus_per_node")
        tag = "-verl"
    return f"{cfg.algo.name}-{cfg.model.name}-{cfg.task.name}-seed{cfg.seed}{tag}-{content_hash(d, length=8)}"


def _check_baselines(cfg: "Config") -> None:
    """Settings of the baselines that span groups (algo and trainer)."""
    if not isinstance(cfg.algo, AlgoConfig) or not isinstance(cfg.trainer, TrainerConfig):
        return  # MISSING while OmegaConf builds the schema
    a, t = cfg.algo, cfg.trainer  # (dynamic sampling keeps groups of one: a no-op at group_size 1)
    if a.overlong.enabled:
        _check(a.overlong.buffer_len <= t.rollout.max_total_tokens,
               f"algo.overlong.buffer_len={a.overlong.buffer_len} must be <= "
               f"trainer.rollout.max_total_tokens={t.rollout.max_total_tokens}")


def _check_on_alarm(cfg: "Config") -> None:
    """trainer.on_alarm=rollback: the own trainer only (verl cannot reload a checkpoint mid-run),
    with checkpoints to roll back to."""
    if not isinstance(cfg.trainer, TrainerConfig) or cfg.trainer.on_alarm != "rollback":
        return
    _check(not isinstance(cfg.backend, BackendConfig) or cfg.backend.name != "verl",
           "trainer.on_alarm=rollback: verl has no rollback (it cannot reload a checkpoint mid-run); with "
           "backend=verl use trainer.on_alarm=stop (stop verl at the first alarm) or none")
    _check(cfg.trainer.save_every > 0,
           "trainer.on_alarm=rollback needs checkpoints to roll back to: set trainer.save_every > 0")


def register_configs() -> None:
    """Register the root schema with Hydra's ConfigStore and the plugins' preset folders with its
    search path (both idempotent). Hydra 1.4 finds the search-path plugin by its entry point
    (pyproject.toml); 1.3 (verl's environment) does not read entry points, so it is registered
    here too — Hydra keeps one registration of a class."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    from stppo.hydra_search_path import StppoSearchPath

    cs = ConfigStore.instance()
    if "stppo_schema.yaml" not in cs.repo:
        cs.store(name="stppo_schema", node=Config)
    Plugins.instance().register(StppoSearchPath)


def to_config(cfg: DictConfig | dict) -> Config:
    """Composed DictConfig → validated dataclasses. Raises ValueError naming the bad field."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):  # composed without the schema
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
    return obj


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> DictConfig:
    """Compose `conf/` with Hydra overrides outside `run.py` (tests, benchmarks, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), **_version_base()):
        return hydra_compose(config_name, overrides=list(overrides))


def _version_base() -> dict:
    """Hydra < 1.4 (verl's environment has 1.3.8) assumes 1.1's defaults, with a warning, unless
    told `version_base`; 1.4 (stppo's pin) deprecates the argument and warns when it is given."""
    import hydra

    major, minor = (int(x) for x in hydra.__version__.split(".")[:2])
    return {"version_base": "1.3"} if (major, minor) < (1, 4) else {}
