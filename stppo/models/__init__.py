"""Policy models, tokenizers, the critic and per-token log-probs (docs/design.md, "Layout": stppo/models/)."""

from stppo.models.critic import ValueModel
from stppo.models.loading import (ModelUnavailable, build_random_model, count_parameters,
                                  default_device, default_dtype, enable_checkpointing, load_model,
                                  random_config, smollm2_checkpoint, smollm2_gguf_path)
from stppo.models.logprobs import (head_log_probs, logits_chunk, policy_log_probs,
                                   policy_log_probs_sum_pi_squared, position_ids_from_mask,
                                   reference_model, set_logits_chunk, split_head)
from stppo.models.precision import Precision, resolve_precision
from stppo.models.presets import (MODEL_PRESETS, ModelPreset, get_model_preset, published_arch,
                                  register_model_preset)
from stppo.models.tokenizer import (EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, load_tokenizer,
                                    tags_are_single_tokens, train_tokenizer)

__all__ = [
    "EOS_TOKEN", "MODEL_PRESETS", "ModelPreset", "ModelUnavailable", "PAD_TOKEN", "Precision",
    "SPECIAL_TOKENS", "ValueModel",
    "build_random_model", "count_parameters", "default_device", "default_dtype",
    "enable_checkpointing", "get_model_preset", "head_log_probs", "load_model", "load_tokenizer",
    "logits_chunk", "policy_log_probs", "policy_log_probs_sum_pi_squared",
    "position_ids_from_mask", "published_arch",
    "random_config", "reference_model", "register_model_preset", "resolve_precision",
    "set_logits_chunk", "smollm2_checkpoint", "smollm2_gguf_path", "split_head",
    "tags_are_single_tokens", "train_tokenizer",
]
