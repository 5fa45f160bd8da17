"""Tiny random-weight models built offline (no hub access), cached per checkout.

A byte-level BPE tokenizer trained on generated text, and a fp32 Llama with
``initializer_range=0.15`` so greedy decoding is not degenerate.
"""

from __future__ import annotations

import json
import os
import random

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", ".cache", "models")


def _tokenizer(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["pool", "cache", "layer", "block", "token", "prefix", "vllm", "ascend", "store", "key",
             "value", "load", "save", "chunk", "hash", "model", "tiny", "random", "weight", "the"]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)


def build_llama(name: str = "llama-tiny", layers: int = 4, hidden: int = 128, heads: int = 4,
                kv_heads: int = 2, vocab_size: int = 512) -> str:
    """Build (once) and return the directory of a tiny random Llama."""
    out_dir = os.path.abspath(os.path.join(ROOT, name))
    if os.path.exists(os.path.join(out_dir, "done")):
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    _tokenizer(out_dir, vocab_size)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=4096, initializer_range=0.15,
                      bos_token_id=0, eos_token_id=1, torch_dtype="float32", tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "done"), "w") as f:
        json.dump({"layers": layers}, f)
    return out_dir


if __name__ == "__main__":
    print(build_llama())
