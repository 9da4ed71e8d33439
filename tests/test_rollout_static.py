"""The static decoding path (`stppo.rollout.static`, trainer.rollout.engine=static) on the CPU,
where it runs without CUDA graphs: for the same seed it samples the same ids as the eager engine
and gives the same log-probs (float32, 1e-5) — greedy and sampled, across bucket changes, stop
tags that span tokens, truncation at the total-length limit and GRPO groups sharing a prompt —
and it reads a low-precision copy of the policy that follows the policy's weights.

`STPPO_TEST_DEVICE=cuda` (scripts/gpu_run.sh) runs the same tests on a GPU, where the static
path replays CUDA graphs, plus the graphs-on vs graphs-off comparison."""

import dataclasses
import os

import pytest
import torch

from stppo.models import MODEL_PRESETS, build_random_model
from stppo.rollout import RolloutConfig, rollout
from stppo.rollout import engine as engine_module
from stppo.rollout import static as static_module
from stppo.rollout.staticstep import cache_columns
from stppo.rollout.weights import sampler_model
from test_rollout import QUESTIONS, PeopleEnv, sft, text_tag_tokenizer
from test_rollout import tok  # noqa: F401 (fixture)

GROUPS = [q for q in QUESTIONS for _ in range(3)]  # 4 prompts x 3 samples: GRPO groups
DEVICE = torch.device(os.environ.get("STPPO_TEST_DEVICE") or "cpu")
TOL = 1e-5 if DEVICE.type == "cpu" else 1e-4  # other kernels on a GPU (both engines float32)


@pytest.fixture(scope="module")
def ttok():
    return text_tag_tokenizer()


@pytest.fixture(scope="module")
def models(tok, ttok):
    """{(tags, trained): (model, tokenizer)}: tags as special tokens or as multi-token text."""
    out = {}
    for tags, tk in (("special", tok), ("text", ttok)):
        out[tags, False] = (build_random_model(MODEL_PRESETS["tiny"].arch, tk, seed=0).eval(), tk)
        torch.manual_seed(0)
        out[tags, True] = (sft(build_random_model(MODEL_PRESETS["tiny"].arch, tk, seed=0), tk,
                               steps=60), tk)
    out = {k: (m.to(DEVICE), tk) for k, (m, tk) in out.items()}
    return out


@pytest.fixture
def buckets(monkeypatch):
    """The bucket sizes the static engine's decoding steps ran at."""
    seen: list[int] = []
    real = static_module.StaticEngine._run_step

    def spy(self, b, greedy):
        seen.append(b)
        return real(self, b, greedy)

    monkeypatch.setattr(static_module.StaticEngine, "_run_step", spy)
    return seen


def both(model, tk, questions, cfg, seed=3, env=PeopleEnv):
    eager = rollout(model, tk, env(), questions, dataclasses.replace(cfg, engine="eager"),
                    generator=torch.Generator().manual_seed(seed))
    static = rollout(model, tk, env(), questions, dataclasses.replace(cfg, engine="static"),
                     generator=torch.Generator().manual_seed(seed))
    return eager, static


def assert_same(a, b):
    assert torch.equal(a.input_ids, b.input_ids)
    for name in ("attention_mask", "loss_mask", "turn_ids", "num_turns", "finished", "truncated",
                 "scores", "num_valid", "num_searches"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.rollout_log_probs - b.rollout_log_probs).abs().max() <= TOL


@pytest.mark.parametrize("tags", ["special", "text"])
@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("greedy", [False, True])
def test_static_samples_what_eager_samples(models, buckets, tags, trained, greedy):
    model, tk = models[tags, trained]
    cfg = RolloutConfig(max_new_tokens=12, max_total_tokens=200, greedy=greedy, check_every=3)
    eager, static = both(model, tk, GROUPS, cfg)
    assert_same(eager, static)
    assert static.loss_mask.sum() > 0 and buckets[0] == 16  # 12 rows in the bucket of 16
    if trained and not greedy:  # rows end at different steps: the batch shrinks to smaller buckets
        assert eager.finished.any() and min(buckets) < 16
        assert set(buckets) <= {1, 2, 4, 8, 16}


@pytest.mark.parametrize("tags", ["special", "text"])
def test_static_truncates_at_the_total_length_like_eager(models, tags):
    model, tk = models[tags, False]  # a random model never stops: every row hits the limit
    cfg = RolloutConfig(max_new_tokens=12, max_total_tokens=60, check_every=5)
    eager, static = both(model, tk, GROUPS, cfg)
    assert_same(eager, static)
    assert static.truncated.all() and int(static.attention_mask.sum(1).max()) == 60


def test_text_stop_tags_are_cut_exactly_after_overshooting(models):
    """With the host looking only every 16 steps, rows keep decoding past a multi-token tag; the
    ids after it are discarded and the next turn continues from the tag."""
    model, tk = models["text", True]
    cfg = RolloutConfig(max_new_tokens=24, max_total_tokens=300, check_every=16)
    eager, static = both(model, tk, GROUPS, cfg)
    assert_same(eager, static)
    texts = [a for acts in static.meta["actions"] for a in acts]
    ended = [t for t in texts if t.endswith(("</search>", "</answer>"))]
    assert ended and all(t.count("</") == 1 for t in ended)  # nothing after the tag


def test_grouped_kv_heads(tok):
    """Query heads sharing a KV head (Qwen2.5, SmolLM2) attend without repeated keys."""
    arch = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    model = build_random_model(arch, tok, seed=1).eval().to(DEVICE)
    cfg = RolloutConfig(max_new_tokens=10, max_total_tokens=150, check_every=4)
    assert_same(*both(model, tok, GROUPS, cfg))


def test_same_seed_same_static_rollout(models):
    model, tk = models["special", False]
    cfg = RolloutConfig(max_new_tokens=8, max_total_tokens=120, engine="static")
    a, b, c = (rollout(model, tk, PeopleEnv(), QUESTIONS, cfg,
                       generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2))
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.rollout_log_probs, b.rollout_log_probs)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_engine_is_kept_and_grows_with_the_rows(models):
    model, tk = models["special", False]
    cfg = RolloutConfig(max_new_tokens=6, max_total_tokens=100, engine="static")
    rollout(model, tk, PeopleEnv(), QUESTIONS, cfg, generator=torch.Generator().manual_seed(0))
    first = static_module.cached_engine(model, cfg)
    assert first.capacity == 4 and first.kv.columns == cache_columns(100) == 112
    rollout(model, tk, PeopleEnv(), QUESTIONS[:2], cfg, generator=torch.Generator().manual_seed(0))
    assert static_module.cached_engine(model, cfg) is first  # fewer rows: the same buffers
    rollout(model, tk, PeopleEnv(), GROUPS, cfg, generator=torch.Generator().manual_seed(0))
    assert static_module.cached_engine(model, cfg).capacity == 16


def test_engine_choice(models):
    model, tk = models["special", False]
    auto = "static" if DEVICE.type == "cuda" else "eager"  # auto: static on CUDA only
    assert engine_module.resolve_engine(model, RolloutConfig()) == auto
    assert engine_module.resolve_engine(model, RolloutConfig(engine="static")) == "static"
    hook = model.model.layers[0].register_forward_hook(lambda *a: None)
    try:  # the lean code does not reproduce hooks: auto stays eager, static is one clear error
        assert engine_module.resolve_engine(model, RolloutConfig(engine="auto")) == "eager"
        with pytest.raises(ValueError, match="engine=static needs a Qwen2 or Llama model"):
            engine_module.resolve_engine(model, RolloutConfig(engine="static"))
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="rollout.engine='fast'"):
        RolloutConfig(engine="fast")


def test_sampler_copy_follows_the_policy_in_place(tok):
    """Under bfloat16 autocast the static path decodes with a bfloat16 copy of the float32
    policy; an optimizer step changes the policy and the next rollout's copy, in place."""
    policy = build_random_model(MODEL_PRESETS["tiny"].arch, tok, seed=0).to(DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        copy = sampler_model(policy)
        assert copy is not policy and copy.lm_head.weight.dtype == torch.bfloat16
        assert copy.model.rotary_emb.inv_freq.dtype == torch.float32
        ptrs = [p.data_ptr() for p in copy.parameters()]
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        policy.lm_head.weight.sum().backward()
        opt.step()
        again = sampler_model(policy)
    assert again is copy and [p.data_ptr() for p in again.parameters()] == ptrs
    for mine, theirs in zip(again.parameters(), policy.parameters()):
        assert torch.equal(mine, theirs.detach().to(torch.bfloat16))
    assert sampler_model(policy) is policy  # no autocast: the policy itself


def test_static_rollout_under_bf16_autocast_reads_the_copy(models):
    model, tk = models["special", True]
    cfg = RolloutConfig(max_new_tokens=12, max_total_tokens=200, engine="static")
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        batch = rollout(model, tk, PeopleEnv(), GROUPS, cfg, generator=torch.Generator().manual_seed(0))
        assert static_module.cached_engine(sampler_model(model), cfg) is not None
    assert batch.finished.any() and torch.isfinite(batch.rollout_log_probs).all()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs: STPPO_TEST_DEVICE=cuda on a GPU")
@pytest.mark.parametrize("greedy", [False, True])
def test_cuda_graphs_replay_the_plain_steps(models, buckets, greedy):
    """Each bucket's captured step gives the ids and log-probs of the same step run as plain
    calls, bit for bit, and a rollout's steps run at several buckets."""
    model, tk = models["text", True]
    cfg = RolloutConfig(max_new_tokens=16, max_total_tokens=300, greedy=greedy, engine="static")
    plain = rollout(model, tk, PeopleEnv(), GROUPS, dataclasses.replace(cfg, cuda_graphs=False),
                    generator=torch.Generator().manual_seed(5))
    graphed = rollout(model, tk, PeopleEnv(), GROUPS, cfg, generator=torch.Generator().manual_seed(5))
    assert torch.equal(plain.input_ids, graphed.input_ids)
    assert torch.equal(plain.rollout_log_probs, graphed.rollout_log_probs)
    assert static_module.cached_engine(model, cfg)._graphs  # captured, not plain calls


def test_decoding_steps_can_be_timed_and_their_bytes_counted(models):
    """What benchmarks/bench_rollout.py reads for the decoding bandwidth: (bucket, steps, s) per
    run of steps between two checks, and the bytes a step at a bucket must move."""
    model, tk = models["special", False]
    cfg = RolloutConfig(max_new_tokens=8, max_total_tokens=100, engine="static", check_every=4)
    rollout(model, tk, PeopleEnv(), GROUPS, cfg, generator=torch.Generator().manual_seed(0))
    engine = static_module.cached_engine(model, cfg)
    engine.timings = []
    batch = rollout(model, tk, PeopleEnv(), GROUPS, cfg, generator=torch.Generator().manual_seed(0))
    runs, engine.timings = engine.timings, None
    assert runs and all(b in (1, 2, 4, 8, 16) and 1 <= k <= 4 and t > 0 for b, k, t in runs)
    assert sum(k for _, k, _ in runs) >= int(batch.loss_mask.sum(1).max()) - 1
    c = model.config
    kv_row = 2 * c.num_hidden_layers * c.num_key_value_heads * 32 * engine.kv.columns * 4
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert static_module.step_bytes(engine, 16) == weights + 16 * kv_row + 2 * 16 * c.vocab_size * 4
