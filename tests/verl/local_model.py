"""A local stand-in for a hub model folder (no model hub here): a 1-layer Qwen2 `config.json` and a
byte-level BPE tokenizer trained on Search-R1 text, with ChatML special tokens and a ChatML chat
template as Qwen2.5-Instruct has. The tool tags stay ordinary text, as in Qwen's tokenizer. Only
verl's config and dataset code read it (no weights)."""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def make_local_model(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    from stppo.envs.prompts import SEARCH_R1_TEMPLATE

    if (path / "config.json").is_file():
        return path
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [SEARCH_R1_TEMPLATE.format(question="who wrote the book?"),
             "<think>x</think><search> query </search><information>Doc 1(Title: a) b</information>"
             "<answer> Beijing </answer>"] * 20
    core.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    Qwen2Config(architectures=["Qwen2ForCausalLM"], vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id).save_pretrained(path)
    return path


def make_random_model(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """`make_local_model`'s tokenizer with a random-init Qwen2 of `hidden` × `layers` and its weights
    (safetensors), for verl's FSDP engine to load: the actor-update tests."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (path / "model.safetensors").is_file():
        return path
    make_local_model(path)
    tok = Qwen2Config.from_pretrained(path)  # the 1-layer config: its vocabulary and special ids
    cfg = Qwen2Config(architectures=["Qwen2ForCausalLM"], vocab_size=tok.vocab_size, hidden_size=hidden,
                      intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path
