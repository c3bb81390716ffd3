"""Worker for tests/test_dschat.py: a GRPO loop written the DeepSpeed-Chat step-3 way.

Nothing here names ds_hilore. As in DeepSpeed-Chat's ``rlhf_engine.py`` and step-3
``main.py``: the ds_configs are built in code, the actor's engine comes from a plain
``deepspeed.initialize`` with a client optimizer, the reference model's from one without an
optimizer (ZeRO stage 0), and every iteration switches the actor's gradient checkpointing off
for generation (``model.generate`` under ``torch.no_grad()``) and on for the update. The loss
is computed here (a clipped GRPO surrogate with a k3 KL term and the token-mean aggregation),
as DeepSpeed-Chat computes its own ``actor_loss_fn``.

Run as ``deepspeed script.py`` it trains with transformers' gradient checkpointing; as
``deepspeed --module ds_hilore.run script.py`` every training engine is HiLoRe's. Each rank
reports every micro-step's loss and reward (float.hex), the SHA-256 of the final parameters,
the engine classes and the actor's HiLoRe stats.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

SEED = 1234
VOCAB, PROMPT_LEN, NEW_TOKENS, GROUP = 64, 4, 6, 4
MICRO_BATCH, GAS = GROUP, 2  # per rank and step: GAS prompts x GROUP completions, one prompt a micro-step
CLIP, BETA, LR = 0.2, 0.05, 1e-2


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    actor, reference = create_engines()
    record = {"losses": [], "rewards": [], "toggles": []}
    for step in range(args.steps):
        seqs, mask, rewards = generate_experience(actor, step, rank)
        actor.gradient_checkpointing_enable()  # DeepSpeed-Chat: on for the update ...
        record["toggles"].append(actor.module.is_gradient_checkpointing)
        train_rlhf(actor, reference, seqs, mask, rewards, record)
        actor.gradient_checkpointing_disable()  # ... off again before the next generation
        record["rewards"].extend(r.hex() for r in rewards.tolist())
    report(args.result_dir, rank, actor, reference, record)


# ---- engines, as DeepSpeed-Chat's DeepSpeedRLHFEngine builds them ---------------------------
def create_hf_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         attn_implementation="eager")
    return Qwen2ForCausalLM(config)


def get_train_ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "steps_per_print": 1_000_000}


def get_eval_ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": {"stage": 0},
            "steps_per_print": 1_000_000}


def create_engines():
    actor_model = create_hf_model()
    optimizer = torch.optim.AdamW(actor_model.parameters(), lr=LR)
    actor, *_ = deepspeed.initialize(model=actor_model, optimizer=optimizer, config=get_train_ds_config())
    reference, *_ = deepspeed.initialize(model=create_hf_model(), config=get_eval_ds_config())
    reference.eval()
    return actor, reference


# ---- one iteration ----------------------------------------------------------------------------
def generate_experience(actor, step: int, rank: int):
    """GROUP sampled completions of each of this rank's prompts, and their rewards."""
    actor.eval()
    gen = torch.Generator().manual_seed(SEED + 100 * step + rank)
    prompts = torch.randint(2, VOCAB, (GAS, PROMPT_LEN), generator=gen).repeat_interleave(GROUP, 0)  # (P·G, Tp)
    torch.manual_seed(SEED + 100 * step + rank)
    with torch.no_grad():
        seqs = actor.module.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)  # (P·G, T)
    actor.train()
    mask = torch.zeros_like(seqs[:, 1:], dtype=torch.float32)  # (P·G, T-1): completion tokens
    mask[:, PROMPT_LEN - 1:] = 1.0
    completions = seqs[:, PROMPT_LEN:]
    rewards = (completions % 2 == 0).float().mean(-1)  # (P·G,) share of even token ids
    return seqs, mask, rewards


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    grouped = rewards.view(-1, GROUP)  # (P, G)
    return ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)).view(-1)


def log_probs(model, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=seqs).logits[:, :-1].float()  # (B, T-1, V)
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)  # (B, T-1)


def actor_loss_fn(logp, old_logp, ref_logp, advantages, mask) -> torch.Tensor:
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    surrogate = -torch.min(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3
    return ((surrogate + BETA * kl) * mask).sum() / mask.sum()


def train_rlhf(actor, reference, seqs, mask, rewards, record) -> None:
    advantages = group_advantages(rewards)
    with torch.no_grad():
        old_logp = log_probs(actor, seqs)
        ref_logp = log_probs(reference, seqs)
    for micro in range(GAS):
        rows = slice(micro * MICRO_BATCH, (micro + 1) * MICRO_BATCH)
        loss = actor_loss_fn(log_probs(actor, seqs[rows]), old_logp[rows], ref_logp[rows], advantages[rows],
                             mask[rows])
        actor.backward(loss)
        actor.step()
        record["losses"].append(loss.item().hex())


# ---- report -----------------------------------------------------------------------------------
def report(result_dir: str, rank: int, actor, reference, record: dict) -> None:
    from tests.launch import write_result

    digest = hashlib.sha256()
    for name, param in sorted(actor.module.named_parameters()):
        digest.update(name.encode() + param.detach().numpy().tobytes())
    hilore = getattr(actor, "hilore", None)
    stats = None
    if hilore is not None:
        stats = {key: hilore.stats[key] for key in ("actions", "recomputed_units")}
        stats["exposure_sources"] = sorted({mb["exposure_source"] for mb in hilore.stats["microbatches"]})
    write_result(result_dir, rank, {
        "rank": rank, "world_size": dist.get_world_size(), **record,
        "actor_class": type(actor).__name__, "reference_class": type(reference).__name__,
        "reference_hilore": getattr(reference, "hilore", None) is not None,
        "initialize_replaced": type(deepspeed.initialize).__name__ == "TrainingInitialize",
        "ds_hilore_imported": "ds_hilore" in sys.modules,
        "hilore_stats": stats, "param_sha": digest.hexdigest(),
    })


if __name__ == "__main__":
    main()
