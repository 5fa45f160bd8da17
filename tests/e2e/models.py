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
                kv_heads: int = 2, vocab_size: int = 512, seed: int = 0, root: str = ROOT) -> str:
    """Build (once) and return the directory ``root/name`` of a tiny random Llama whose
    weights are drawn from ``seed`` (another seed: the same shapes, other weights)."""
    out_dir = os.path.abspath(os.path.join(root, name))
    if os.path.exists(os.path.join(out_dir, "done")):
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    _tokenizer(out_dir, vocab_size)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=4096, initializer_range=0.15,
                      bos_token_id=0, eos_token_id=1, torch_dtype="float32", tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "done"), "w") as f:
        json.dump({"layers": layers}, f)
    return out_dir


def build_lora(base_dir: str, out_dir: str, seed: int, rank: int = 8) -> str:
    """A random LoRA adapter for ``build_llama``'s model, in PEFT's file layout
    (adapter_config.json + adapter_model.safetensors), on q/k/v/o: it changes the KV, so
    KV computed without it (or with another adapter) gives other tokens."""
    import torch
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(base_dir, "config.json")))
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": hidden, "k_proj": cfg["num_key_value_heads"] * head_dim,
            "v_proj": cfg["num_key_value_heads"] * head_dim, "o_proj": hidden}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out in outs.items():
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.2
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_dir,
                   "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none",
                   "target_modules": list(outs), "fan_in_fan_out": False, "modules_to_save": None}, f)
    return out_dir


HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def build_hybrid(kind: str) -> str:
    """Build (once) a tiny random bf16 hybrid model (GDN head dim 64: the smallest the CPU
    kernel takes): ``qwen3_next`` (Qwen3-Next) or ``qwen3_5``
    (Qwen3.5 text): Gated-DeltaNet and full-attention layers alternating."""
    out_dir = os.path.abspath(os.path.join(ROOT, f"{kind}-tiny"))
    if os.path.exists(os.path.join(out_dir, "done")):
        return out_dir
    import torch

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=64, layer_types=HYBRID_LAYERS,
                  linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.15, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        # vLLM's Qwen3-Next needs its sparse MoE blocks: four small experts.
        cfg = Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, torch_dtype="bfloat16")
        model_cls = Qwen3NextForCausalLM
    elif kind == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(**common, torch_dtype="bfloat16")
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        model_cls = Qwen3_5ForCausalLM
    else:
        raise ValueError(kind)
    os.makedirs(out_dir, exist_ok=True)
    _tokenizer(out_dir, 512)
    torch.manual_seed(0)
    model_cls(cfg).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "done"), "w") as f:
        json.dump({"layers": HYBRID_LAYERS}, f)
    return out_dir


def build_mla(name: str = "mla-tiny", layers: int = 2) -> str:
    """Build (once) a tiny random bf16 DeepSeek-V2-style MLA model. vLLM's CPU MLA kernel
    only takes DeepSeek's latent width (kv_lora_rank 512 + rope 64 = 576) in bf16/fp16;
    everything else is small, and the MLP is dense (no experts) in every layer."""
    out_dir = os.path.abspath(os.path.join(ROOT, name))
    if os.path.exists(os.path.join(out_dir, "done")):
        return out_dir
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    _tokenizer(out_dir, 512)
    torch.manual_seed(0)
    cfg = DeepseekV2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                           qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                           first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=64, max_position_embeddings=4096, initializer_range=0.15,
                           bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16")
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "done"), "w") as f:
        json.dump({"layers": layers}, f)
    return out_dir


if __name__ == "__main__":
    print(build_llama())
