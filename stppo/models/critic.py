"""The critic: a separate backbone of the policy's architecture with a scalar value head.

Alignment matches the log-probs (stppo/batch.py): values[:, t] is V(s_t), the estimate for the
state in which token t is generated, i.e. the head applied to the hidden state at t−1:
    values[:, t] = w · h_{t−1} + b   (t ≥ 1),   values[:, 0] = 0,
so values[:, t] depends only on ids[:, :t]. Padding positions carry 0, and so do positions
outside `positions` when given: the trainer asks for agent tokens only (GAE, the value loss and
explained variance read nothing else), so the head runs on those hidden states only, in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

from stppo.models.loading import enable_checkpointing
from stppo.models.logprobs import (hidden_states, linear_fp32, scatter_rows, target_positions)

_CONFIG = "config.json"
_WEIGHTS = "value_model.safetensors"
_META = "value_model.json"


class ValueModel(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        self.backbone = AutoModel.from_config(config)
        self.value_head = nn.Linear(config.hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=getattr(config, "initializer_range", 0.02))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy, *, init_from_policy: bool = True) -> "ValueModel":
        """A critic with the policy's architecture, its backbone optionally copied from the policy
        (the value head is always fresh). Same parameter dtype and device as the policy."""
        param = next(policy.parameters())
        critic = cls(policy.config)
        if init_from_policy:
            critic.backbone.load_state_dict(policy.base_model.state_dict())
        return critic.to(device=param.device, dtype=param.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.values(input_ids, attention_mask)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T) ids and mask → (N, T) float32 values, aligned as in the module docstring;
        `positions` (bool (N, T)): compute only there (0 elsewhere)."""
        if input_ids.dim() != 2 or tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must both be (N, T)")
        mask = attention_mask.bool()
        sel = target_positions(mask, positions)  # (N, T-1): V(s_t) for t >= 1
        hidden = hidden_states(self.backbone, input_ids, mask)  # (N, T, H)
        v = linear_fp32(hidden[:, :-1][sel], self.value_head).squeeze(-1)  # (M,) float32
        return scatter_rows(v, sel)  # (N, T)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute the backbone's activations in the backward pass (the policy's option)."""
        enable_checkpointing(self.backbone)

    def save(self, path: str | Path) -> Path:
        """Write config.json, the weights (safetensors) and the dtype to directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(path))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / _WEIGHTS))
        dtype = str(next(self.parameters()).dtype).removeprefix("torch.")
        (path / _META).write_text(json.dumps({"dtype": dtype}))
        return path

    @classmethod
    def load(cls, path: str | Path, *, device: str | torch.device = "cpu") -> "ValueModel":
        path = Path(path)
        missing = [f for f in (_CONFIG, _WEIGHTS, _META) if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"value model directory {path} lacks {', '.join(missing)}; "
                                    "expected a directory written by ValueModel.save")
        critic = cls(AutoConfig.from_pretrained(str(path)))
        critic.load_state_dict(load_file(str(path / _WEIGHTS)))
        dtype = getattr(torch, json.loads((path / _META).read_text())["dtype"])
        return critic.to(device=device, dtype=dtype)
