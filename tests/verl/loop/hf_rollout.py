"""TEST-ONLY rollout engine for verl 0.9.1: transformers' `generate` behind verl's rollout interfaces.

verl's agent loop asks a rollout *server* (a Ray actor) for tokens:
`server.generate.remote(prompt_ids=…, sampling_params=…, request_id=…, image_data, video_data)`
→ `TokenOutput(token_ids, log_probs, stop_reason, extra_fields)`. vLLM and SGLang serve that on a
GPU; here, with no vLLM (a CPU, or a CUDA machine without it), three small pieces do:

* `HFServer` — the server actor: the model loaded with transformers on the worker's device;
  `generate` samples one request (temperature / top-p / top-k, greedy at temperature 0), stops at
  EOS, the request's stop token ids and its stop strings (Search-R1's `</search>`, `</answer>`,
  kept in the output as vLLM's `include_stop_str_in_output`) and returns the sampled tokens with
  their log-probs under the sampling temperature. Requests run one at a time (a lock): the
  models here are tiny. Sleep / wake-up / KV-cache / abort / profile calls are no-ops (no cache
  to free).
* `HFReplica` — verl's `RolloutReplica` for it (registered as `REPLICA_NAME`): one server per
  replica, on the node of its first worker, seeing that worker's accelerator (the
  `RAY_EXPERIMENTAL_NOSET_*` variable keeps Ray from hiding it, as verl's vLLM replica does).
* `HFServerAdapter` — the worker-side `BaseRollout` that verl's `ActorRolloutRefWorker` builds
  for the rollout name: verl's "naive" weight sync hands it `(name, tensor)` pairs after every
  update; rank 0 of the replica sends them (on the CPU) to the server, which loads them with
  `load_state_dict(strict=True)` — a name verl exports that the model lacks is an error.

`loop/plugin.py` registers the replica and the adapter (the adapter through a private dict of
verl's, listed there).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

SERVER_PREFIX = "stppo_hf_server_"  # + replica rank: the server actor's name


def _dtype(name: str | None) -> torch.dtype:
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}.get(str(name), torch.float32)


class HFServer:
    """The rollout server actor (see the module docstring); `device` is "cpu" or "cuda"."""

    def __init__(self, config, model_config, device: str, visible_devices: Optional[str] = None):
        if visible_devices is not None and device == "cuda":  # before torch touches CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.config, self.device = config, torch.device(device)
        if device == "cpu":
            torch.set_num_threads(1)  # one of the machine's few cores; the trainer has the rest
        path = model_config.local_path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(config.dtype)).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.global_steps = None
        self.lock = asyncio.Lock()
        self.weight_updates = 0

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, **kwargs) -> TokenOutput:
        if image_data or video_data or kwargs.get("audio_data"):
            raise NotImplementedError("the HF test rollout serves text prompts only")
        async with self.lock:
            return await asyncio.to_thread(self._generate, list(prompt_ids), dict(sampling_params))

    def _max_tokens(self, prompt_len: int) -> int:
        """vLLM's budget in verl: the response length, within prompt + response and the model."""
        c = self.config
        budget = min(c.response_length, c.prompt_length + c.response_length - prompt_len)
        limit = c.max_model_len or getattr(self.model.config, "max_position_embeddings", budget + prompt_len)
        return max(0, min(budget, limit - prompt_len))

    def _generate(self, prompt_ids: list[int], params: dict[str, Any]) -> TokenOutput:
        max_tokens = self._max_tokens(len(prompt_ids))
        if max_tokens == 0:
            return TokenOutput(token_ids=[], log_probs=[] if params.get("logprobs") else None,
                               stop_reason="completed", extra_fields={"global_steps": self.global_steps})
        temperature = float(params.get("temperature", 1.0))
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": temperature > 0, "output_logits": True,
                              "return_dict_in_generate": True,
                              "eos_token_id": self.eos_ids + list(params.get("stop_token_ids") or []),
                              "pad_token_id": self.tokenizer.pad_token_id}
        if temperature > 0:
            kw.update(temperature=temperature, top_p=float(params.get("top_p", 1.0)),
                      top_k=int(params["top_k"]) if int(params.get("top_k", -1)) > 0 else 0)
        if params.get("stop"):
            kw.update(stop_strings=list(params["stop"]), tokenizer=self.tokenizer)
        ids = torch.tensor([prompt_ids], device=self.device)  # (1, P)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        new = out.sequences[0, ids.shape[1]:]  # (T,)
        log_probs = None
        if params.get("logprobs"):
            logits = torch.stack(out.logits, dim=1)[0].float()  # (T, V) before any processing
            scaled = logits / temperature if temperature > 0 else logits
            log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, new[:, None])[:, 0].tolist()
        return TokenOutput(token_ids=new.tolist(), log_probs=log_probs, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    async def update_weights(self, state: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> int:
        """Load the trainer's weights (full tensors, HF names); returns the number of syncs so far."""
        async with self.lock:
            params = {k: v.to(self.device, dtype=self.model.dtype) if v.is_floating_point() else v.to(self.device)
                      for k, v in state.items()}
            self.model.load_state_dict(params, strict=True)
            self.global_steps = global_steps
            self.weight_updates += 1
            return self.weight_updates

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def _noop(self, *args, **kwargs) -> None:
        return None

    wake_up = sleep = clear_kv_cache = release_kv_cache = resume_kv_cache = resume_generation = _noop
    start_profile = stop_profile = wait_for_requests_to_drain = _noop


class HFReplica(RolloutReplica):
    """One `HFServer` per replica (hybrid: beside the training workers; standalone: its pool's)."""

    async def launch_servers(self):
        from verl.utils.device import get_device_name, get_resource_name
        from verl.plugin.platform import get_platform

        def where(worker_self):  # runs inside the first worker
            ctx = ray.get_runtime_context()
            ids = ctx.get_accelerator_ids().get(get_resource_name(), [])
            return ctx.get_node_id(), ",".join(str(i) for i in ids) or None

        node_id, visible = await self.workers[0].__ray_call__.remote(where)
        env = {var: "1" for var in get_platform().ray_noset_envvars()}
        server = ray.remote(HFServer).options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id,
                                                                                            soft=False),
            runtime_env={"env_vars": env}, name=f"{SERVER_PREFIX}{self.replica_rank}{self.name_suffix}",
            max_concurrency=self.max_concurrency,
        ).remote(self.config, self.model_config, get_device_name(), visible)
        await server.set_global_steps.remote(None)  # raises here if the server failed to start
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{SERVER_PREFIX}{self.replica_rank}{self.name_suffix}"  # a key, no HTTP


class HFServerAdapter(BaseRollout):
    """The training worker's side of the HF rollout: receives the weights (see the module docstring)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        c = self.config
        world = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader = rank % world == 0
        self._server = None

    @property
    def server(self):
        if self._server is None:
            self._server = ray.get_actor(f"{SERVER_PREFIX}{self.replica_rank}")
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the HF test rollout takes full named tensors, not {wire_format!r}")
        state: dict[str, torch.Tensor] = {}
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                state[name] = _to_cpu(tensor)
        else:
            for name, tensor in weights:
                state[name] = _to_cpu(tensor)
        if self.is_leader:
            await self.server.update_weights.remote(state, kwargs.get("global_steps"))


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().to("cpu", copy=True)
