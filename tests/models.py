"""Tiny transformers models with random weights, built from configs (no downloads)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(attention_dropout=0.1)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(attention_dropout=0.1)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(attention_dropout=0.1)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
             dict(attention_dropout=0.1, resid_pdrop=0.1, embd_pdrop=0.0, pad_token_id=0)),
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                 dict(attention_dropout=0.1, hidden_dropout=0.1, use_parallel_residual=True,
                      rotary_pct=0.5)),
}


def tiny_model(arch: str = "llama", *, layers: int = 2, hidden: int = 32, heads: int = 4,
               kv_heads: int | None = None, intermediate: int = 64, dropout: bool = True,
               seed: int = 0, **overrides) -> torch.nn.Module:
    """A small causal LM of the given architecture in training mode, fp32, eager attention."""
    config_cls, model_cls, extra = ARCHS[arch]
    kwargs = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, intermediate_size=intermediate,
                  max_position_embeddings=256, tie_word_embeddings=False)
    if arch != "gpt_neox":
        kwargs["num_key_value_heads"] = kv_heads or heads // 2
    if dropout:
        kwargs.update(extra)
    elif arch == "phi3":
        kwargs.update(pad_token_id=0)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config)
    model.train()
    return model


def with_lora(model: torch.nn.Module, r: int = 4) -> torch.nn.Module:
    import peft
    targets = ["query_key_value", "dense"] if "NeoX" in type(model).__name__ else \
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
         "gate_up_proj"]
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    cfg = peft.LoraConfig(r=r, lora_alpha=8, lora_dropout=0.1,
                          target_modules=[t for t in targets if t in present])
    lora = peft.get_peft_model(model, cfg)
    torch.manual_seed(1)
    for name, p in lora.named_parameters():  # non-zero B so every LoRA path carries gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    lora.train()
    return lora


def batch(batch_size: int = 3, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    return {"input_ids": ids, "attention_mask": mask}


def loss_and_grads(model, inputs, *, seed: int = 123, autocast: torch.dtype | None = None):
    """Loss and gradients of every trainable parameter and of the input embeddings."""
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).logits
        weights = torch.linspace(-1.0, 1.0, logits.shape[-1])
        loss = (logits.float().log_softmax(-1) * weights).sum(-1).mean()
    loss.backward()
    embedding = model.get_input_embeddings().weight  # bypassed: inputs_embeds are passed
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if p.requires_grad and p is not embedding}
    grads["<inputs_embeds>"] = embeds.grad.clone()
    return loss.detach(), grads

