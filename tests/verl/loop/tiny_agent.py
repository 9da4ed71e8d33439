"""TEST-ONLY: a tiny model that genuinely calls the search tool under verl's chat prompt.

A random-init model never writes `</search>`, so verl's multi-turn path (tool parser → stppo's
search tool → `<information>` observation → next turn) would never run. This makes a hub-style
model folder whose model does, by the same recipe as stppo's warm start (stppo/train/sft.py: the
oracle's demonstrations, agent tokens only in the loss), but in verl's format:

- tokenizer: byte-level BPE trained on the task's own texts (`stppo.envs.oracle.tokenizer_texts`,
  Search-R1 prompts), ChatML special tokens and a ChatML chat template as Qwen2.5-Instruct has;
- model: a random-init Qwen2 (hidden 64, 2 layers, untied head);
- SFT: the oracle's episodes on the task's `sft` split, played through stppo's `SearchEnv` and
  bm25 retriever (the same documents verl's search tool returns), rendered as the chat verl's
  tool agent loop builds — user prompt, then per turn an assistant message (the action) and a
  tool message (the observation) — with the loss on the assistant tokens.

After `SFT_STEPS` steps it opens with `<search> …</search>` on almost every training question
(measured by `tool_call_rate`), whatever the query quality.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB, HIDDEN, LAYERS, MAX_POSITIONS = 1024, 64, 2, 2048
SFT_STEPS, SFT_BATCH, SFT_LR = 80, 16, 3e-3
DONE = "stppo_tiny_agent.done"


def make_agent_model(path: Path, task, *, topk: int, max_turns: int, seed: int = 0) -> Path:
    """Write the folder (tokenizer, config, safetensors) once; returns `path`."""
    if (path / DONE).is_file():
        return path
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = _tokenizer(task)
    chats = [_chat(ep) for ep in _episodes(task, topk=topk, max_turns=max_turns)]
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        architectures=["Qwen2ForCausalLM"], vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id, bos_token_id=None))
    _sft(model, tok, chats, seed)
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(path)
    (path / DONE).write_text("ok\n")
    return path


def _tokenizer(task):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from stppo.envs.oracle import tokenizer_texts

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(list(tokenizer_texts(task, prompt_styles=("search_r1",))), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    return tok


def _episodes(task, *, topk: int, max_turns: int):
    from stppo.envs import build_retriever
    from stppo.envs.env import SearchEnv
    from stppo.envs.oracle import run_oracle

    env = SearchEnv.for_task(task, build_retriever("bm25", corpus=task.corpus), max_turns=max_turns, topk=topk,
                             prompt_style="search_r1")
    return run_oracle(env, task, task.split("sft"))


def _chat(episode) -> list[dict]:
    """The conversation verl's tool agent loop builds for the episode (tool text = the observation)."""
    messages = [{"role": "user", "content": episode.prompt}]
    for action, result in episode.turns:
        messages.append({"role": "assistant", "content": action})
        if result.observation:
            messages.append({"role": "tool", "content": result.observation})
    return messages


def _encode(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask): 1 on each assistant message's content and its <|im_end|>."""
    ids, mask = [], []
    for i, m in enumerate(messages):
        head = tok.apply_chat_template(messages[:i], tokenize=False) if i else ""
        text = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        part = text[len(head):]
        if m["role"] != "assistant":
            piece = tok(part, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [0] * len(piece)
            continue
        opening = "<|im_start|>assistant\n"
        for chunk, on in ((opening, 0), (part[len(opening):], 1)):
            piece = tok(chunk, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [on] * len(piece)
    return ids, mask


def _sft(model, tok, chats: list[list[dict]], seed: int) -> list[float]:
    """Token-mean NLL of the assistant tokens, AdamW, constant lr; returns the loss curve."""
    encoded = [_encode(tok, c) for c in chats]
    width = max(len(seq) for seq, _ in encoded)  # one shape for every step: CPU kernels stay warm
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(SFT_STEPS):
        pick = torch.randint(len(encoded), (SFT_BATCH,), generator=gen).tolist()
        ids = torch.full((SFT_BATCH, width), tok.pad_token_id)  # (B, L) right-padded
        mask = torch.zeros(SFT_BATCH, width)  # (B, L) loss on assistant tokens
        for row, i in enumerate(pick):
            seq, m = encoded[i]
            ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), torch.tensor(m, dtype=torch.float)
        # right padding under a causal mask: no real token attends to a pad, so no padding mask
        logits = model(input_ids=ids).logits[:, :-1]  # (B, L-1, V)
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view(SFT_BATCH, -1)  # (B, L-1)
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def tool_call_rate(path: Path, task, n: int = 8) -> float:
    """Share of the first `n` train questions on which the saved model opens with a search
    (greedy, verl's first-turn prompt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stppo.envs.prompts import build_prompt

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    hits = 0
    for q in task.split("train")[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": build_prompt(q, "search_r1")}],
                                      add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=["</search>"], tokenizer=tok)
        text = tok.decode(out[0, ids.shape[1]:])
        hits += text.lstrip().startswith("<search>") and "</search>" in text
    return hits / n
