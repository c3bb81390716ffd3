"""A minimal GRPO actor update with ds_hilore, DeepSpeed-Chat style: one call changes.

The rollouts are synthetic (random completions, rewards from a toy rule) so that the script runs
anywhere; the actor update -- forward, GRPO loss with exact coefficients, engine.backward,
engine.step -- is the real one. Launch as any DeepSpeed script:

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/grpo_minimal.py \\
        --deepspeed_config ds_configs/zero2_hilore.json
    DS_ACCELERATOR=cpu mpirun -np 2 python examples/grpo_minimal.py \\
        --deepspeed_config ds_configs/zero2_hilore.json

``--model DIR`` trains a local checkpoint instead of the built-in random Qwen2-shaped model.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers

import ds_hilore
from ds_hilore.grpo import group_advantages, policy_loss

PROMPT, COMPLETION, GROUP = 16, 16, 2  # tokens, tokens, completions per prompt


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed_config", required=True, help="ds_config with a hilore block")
    parser.add_argument("--model", default=None, help="local checkpoint directory (no downloads)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed runner")
    parser.add_argument("--master_port", type=int, default=29500, help="port of rank 0 (mpirun)")
    parser.add_argument("--result_dir", default=None, help="write each rank's summary here (JSON)")
    return parser.parse_args()


def build_actor(path: str | None) -> torch.nn.Module:
    if path is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def setup(args: argparse.Namespace):
    actor = build_actor(args.model)
    actor.gradient_checkpointing_enable()  # with a hilore block this switches HiLoRe on
    # was: deepspeed.initialize(...) -- same arguments; the config comes from --deepspeed_config
    engine, *_ = ds_hilore.initialize(args=args, model=actor, model_parameters=actor.parameters(),
                                      distributed_port=args.master_port)
    return engine


def rollout(engine, step: int, micro: int) -> dict[str, torch.Tensor]:
    """Synthetic rollouts: a batch of prompts, GROUP completions each, toy rewards."""
    rank = torch.distributed.get_rank()
    batch = engine.train_micro_batch_size_per_gpu()
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    vocab = engine.module.config.vocab_size
    ids = torch.randint(0, vocab, (batch, PROMPT + COMPLETION), generator=g)
    ids[GROUP - 1::GROUP, :PROMPT] = ids[0::GROUP, :PROMPT]  # completions of a group share a prompt
    rewards = (ids[:, PROMPT:] % 2 == 0).float().mean(-1)  # (B,) toy rule: even tokens are good
    if micro == 0:  # a group with identical rewards: A = 0, so ω = 0 and HiLoRe elides it
        rewards[:GROUP] = 1.0
    with torch.no_grad():  # the behaviour policy's log-probs (one update per rollout)
        old = completion_logprobs(engine, ids)
    return {"ids": ids, "old": old, "adv": group_advantages(rewards, GROUP),
            "mask": torch.ones_like(old)}


def completion_logprobs(engine, ids: torch.Tensor) -> torch.Tensor:
    logits = engine(input_ids=ids).logits[:, PROMPT - 1:-1].float()  # (B, C, V)
    return logits.log_softmax(-1).gather(-1, ids[:, PROMPT:, None])[..., 0]  # (B, C)


def train(engine, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        for micro in range(engine.gradient_accumulation_steps()):
            data = rollout(engine, step, micro)
            logp = completion_logprobs(engine, data["ids"])
            out = policy_loss(logp, data["old"], data["adv"], data["mask"], model=engine.module)
            engine.backward(out.loss)  # ω went to HiLoRe inside policy_loss
            engine.step()
            losses.append(out.loss.item())
        if engine.global_rank == 0 and engine.hilore is not None:
            stats = engine.hilore.stats
            print(f"step {step + 1}: loss {losses[-1]:+.5f}, actions {stats['actions']}, "
                  f"kept bytes {stats['bytes']}, recomputed units {stats['recomputed_units']}")
    return losses


def cleanup(engine, losses: list[float], result_dir: str | None) -> None:
    if result_dir is not None:
        rank = torch.distributed.get_rank()
        summary = {"rank": rank, "losses": losses, "plan_hash": engine.hilore.plan_hash(),
                   "stats": {k: v for k, v in engine.hilore.stats.items() if k != "microbatches"}}
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(summary, f)
    torch.distributed.barrier()


def main() -> None:
    args = parse_args()
    engine = setup(args)
    losses = train(engine, args.steps)
    cleanup(engine, losses, args.result_dir)


if __name__ == "__main__":
    main()
