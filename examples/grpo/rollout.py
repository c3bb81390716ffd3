"""Rollouts: G sampled completions per prompt, their rewards, advantages and log-probs.

As in DeepSpeed-Chat, generation runs with the actor in eval mode, without gradients and with
gradient checkpointing switched off (HiLoRe included: it is the model's checkpointing), and
switched back on for the update.

Layout of a rollout batch of N = prompts x G sequences (P prompt and C completion columns):

    input_ids       (N, P + C)  prompt left-padded, completion right-padded with <pad>
    attention_mask  (N, P + C)  1 on prompt and completion tokens (completion up to <eos>)
    completion_mask (N, C)      the completion tokens the loss sees, <eos> included
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Iterator, Sequence

import torch
from torch import Tensor

from ds_hilore.grpo import group_advantages, token_logprobs

from .task import REWARDS, Example, Task

__all__ = ["Rollout", "evaluate", "make_rollout", "sequence_logprobs", "set_checkpointing"]


@dataclasses.dataclass
class Rollout:
    """One step's experience on one rank."""

    input_ids: Tensor  # (N, P + C) int64
    attention_mask: Tensor  # (N, P + C) int64
    prompt_len: int  # P
    completion_mask: Tensor  # (N, C) bool
    rewards: Tensor  # (N,) fp32
    advantages: Tensor  # (N,) fp32
    old_logp: Tensor  # (N, C) fp32, the behaviour policy's log-probs
    ref_logp: Tensor | None  # (N, C) fp32, the reference model's (beta > 0)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: Tensor) -> "Rollout":
        """The sequences ``index`` (a minibatch or micro-batch)."""
        return Rollout(_pick(self.input_ids, index), _pick(self.attention_mask, index), self.prompt_len,
                       _pick(self.completion_mask, index), _pick(self.rewards, index),
                       _pick(self.advantages, index), _pick(self.old_logp, index), _pick(self.ref_logp, index))

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens (no padding)."""
        return int(self.attention_mask.sum())


def _pick(t: Tensor | None, index: Tensor) -> Tensor | None:
    return None if t is None else t.index_select(0, index.to(t.device))


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that start at 0 on each row's first real token, as ``generate`` counts them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (N, T)


def sequence_logprobs(model, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """(N, C) fp32 log-probs of the completion tokens under ``model`` (a DeepSpeed engine or a
    module), from the last hidden state in chunks (``token_logprobs``: no (N, C, V) fp32
    logits are held). Under ZeRO-3 the LM head's weight exists only inside the forward, so
    there the forward computes the completion's logits itself."""
    lm = model.module if hasattr(model, "module") else model
    head = lm.get_output_embeddings()
    completion = input_ids[:, prompt_len:]  # (N, C)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=position_ids(attention_mask), use_cache=False)
    if hasattr(head.weight, "ds_numel"):  # partitioned by ZeRO-3
        logits = model(**inputs, logits_to_keep=completion.shape[1] + 1).logits[:, :-1].float()  # (N, C, V)
        return logits.log_softmax(-1).gather(-1, completion[..., None])[..., 0]
    # The decoder's output, caught by a hook on the engine's own forward, not
    # ``output_hidden_states=True``: recording every layer's output tells HiLoRe a loss may
    # read any of them, and it then checks each layer's incoming gradient in the backward
    # (one all-reduce per layer and microbatch under several ranks).
    kept = []
    hook = lm.get_decoder().register_forward_hook(lambda _m, _a, out: kept.append(out[0]))
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    hidden = kept[-1][:, prompt_len - 1:-1]  # (N, C, H): position t predicts t + 1
    return token_logprobs(hidden, head, completion)  # (N, C)


def set_checkpointing(model: torch.nn.Module, enable: bool) -> None:
    """transformers' checkpointing switch (HiLoRe's too, when attached), non-reentrant;
    transformers 5 names it ``activation_checkpointing_*``, earlier versions ``gradient_*``."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    new = hasattr(lm, "activation_checkpointing_enable")
    if not enable:
        (lm.activation_checkpointing_disable if new else lm.gradient_checkpointing_disable)()
    elif new:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def generation_mode(model: torch.nn.Module, checkpointing: bool) -> Iterator[None]:
    """eval(), no_grad, checkpointing off; training mode and checkpointing restored after."""
    if checkpointing:
        set_checkpointing(model, False)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        if checkpointing:
            set_checkpointing(model, True)


def _encode_prompts(tokenizer, examples: Sequence[Example], max_prompt_seq_len: int, device) -> dict:
    batch = tokenizer([e.prompt for e in examples], return_tensors="pt", padding=True,
                      add_special_tokens=False)
    if batch["input_ids"].shape[1] > max_prompt_seq_len:
        raise ValueError(f"a prompt has {batch['input_ids'].shape[1]} tokens, more than "
                         f"--max_prompt_seq_len {max_prompt_seq_len}; raise it.")
    return {k: v.to(device) for k, v in batch.items()}


def _completions(tokenizer, completion_ids: Tensor) -> tuple[list[str | None], Tensor]:
    """Decoded completions (None where no <eos> was written) and the (N, C) completion mask."""
    eos = tokenizer.eos_token_id
    texts, mask = [], torch.zeros(completion_ids.shape, dtype=torch.bool)
    for i, row in enumerate(completion_ids.tolist()):
        end = row.index(eos) if eos in row else None
        texts.append(None if end is None else tokenizer.decode(row[:end], skip_special_tokens=True))
        mask[i, :len(row) if end is None else end + 1] = True
    return texts, mask.to(completion_ids.device)


def generate(model, tokenizer, examples: Sequence[Example], args, *, sample: bool, checkpointing: bool):
    """Token ids (N, P + C), attention mask, prompt length, completion texts and mask."""
    group = args.group_size if sample else 1
    device = next(model.parameters()).device
    prompts = _encode_prompts(tokenizer, examples, args.max_prompt_seq_len, device)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0) if sample \
        else dict(do_sample=False)
    with generation_mode(model, checkpointing):
        # synced_gpus: under ZeRO-3 every forward gathers parameters with all ranks, so a rank
        # whose completions all ended keeps stepping until every rank's have (DeepSpeed-Chat too)
        ids = model.generate(**prompts, max_new_tokens=args.max_answer_seq_len, num_return_sequences=group,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             synced_gpus=args.actor_zero_stage == 3, **sampling)  # (N, P + C)
    prompt_len = prompts["input_ids"].shape[1]
    texts, completion_mask = _completions(tokenizer, ids[:, prompt_len:])
    attention_mask = torch.cat([prompts["attention_mask"].repeat_interleave(group, 0),
                                completion_mask.long()], dim=1)  # (N, P + C)
    return ids, attention_mask, prompt_len, texts, completion_mask


def make_rollout(engine, reference, tokenizer, task: Task, args, step: int, rank: int,
                 checkpointing: bool) -> Rollout:
    """Sample prompts (seeded by seed, step and rank), generate, score, and compute log-probs."""
    rng = random.Random(f"{args.seed}/rollout/{step}/{rank}")
    examples = task.sample(rng, args.per_device_generation_batch_size, "train")
    ids, attention_mask, prompt_len, texts, completion_mask = generate(
        engine.module, tokenizer, examples, args, sample=True, checkpointing=checkpointing)
    reward = REWARDS[task.reward]
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([reward(t, a) for t, a in zip(texts, answers)])  # (N,) fp32
    with torch.no_grad():
        old_logp = sequence_logprobs(engine, ids, attention_mask, prompt_len)  # (N, C)
        ref_logp = None if reference is None else sequence_logprobs(reference, ids, attention_mask, prompt_len)
    return Rollout(ids, attention_mask, prompt_len, completion_mask, rewards,
                   group_advantages(rewards, args.group_size), old_logp, ref_logp)


def evaluate(engine, tokenizer, task: Task, args, rank: int, world_size: int,
             checkpointing: bool) -> tuple[float, int]:
    """Sum and count of the rewards of greedy completions of this rank's share of the held-out
    prompts (the same prompts in every evaluation and every run); the caller sums over ranks."""
    mine = task.held_out(args.num_eval_prompts)[rank::world_size]
    if not mine:
        return 0.0, 0
    *_, texts, _ = generate(engine.module, tokenizer, mine, args, sample=False, checkpointing=checkpointing)
    reward = REWARDS[task.reward]
    return sum(reward(t, e.answer) for t, e in zip(texts, mine)), len(mine)
