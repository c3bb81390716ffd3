"""Worker for tests/test_dschat.py: a training loop written the DeepSpeed-Chat step-3 way.

Nothing here names ds_hilore. As in DeepSpeed-Chat's ``rlhf_engine.py`` and step-3
``main.py``: the ds_configs are built in code; the actor's engine comes from a plain
``deepspeed.initialize`` with a client optimizer (optionally with DeepSpeed-Chat's own LoRA
layers, only the LoRA weights trained), the critic's too -- a ``RewardModel`` (a transformer
backbone and a value head) trained through ``forward_value``, which calls the backbone and never
the critic module itself; the reference actor, the reward model and the actor's EMA copy come
from engines without an optimizer (ZeRO stage 0, or 3 under ZeRO-3), the EMA updated after
every step by DeepSpeed-Chat's ``moving_average`` (gathering ZeRO-3 parameters that are
``NOT_AVAILABLE``). Every iteration switches the actor's gradient checkpointing off for
generation (``model.generate`` under ``torch.no_grad()``) and on for the update; the critic's
is on only with ``--critic_gradient_checkpointing`` (DeepSpeed-Chat's default: off). The actor
loss is a clipped GRPO surrogate with a k3 KL term and the token-mean aggregation, the critic
loss a masked squared error to the returns, computed here as DeepSpeed-Chat computes its own.

Run as ``deepspeed script.py`` it trains with transformers' gradient checkpointing where the
flags ask for it; as ``deepspeed --module ds_hilore.run script.py`` every training engine is
HiLoRe's. Each rank reports every micro-step's losses and rewards (float.hex), the SHA-256 of
the final actor, critic and EMA parameters, every parameter's ZeRO-3 status after every
micro-step, the engine classes, and each HiLoRe engine's settings and stats.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

SEED = 1234
VOCAB, PROMPT_LEN, NEW_TOKENS, GROUP = 64, 4, 6, 4
MICRO_BATCH, GAS = GROUP, 2  # per rank and step: GAS prompts x GROUP completions, one prompt a micro-step
CLIP, BETA, LR, EMA_BETA = 0.2, 0.05, 1e-2, 0.992
LORA_DIM = 4


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--actor_lora_dim", type=int, default=0)
    parser.add_argument("--critic_gradient_checkpointing", action="store_true")
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    engines = create_engines(args)
    record = {"losses": [], "critic_losses": [], "rewards": [], "toggles": [], "ds_status": []}
    for step in range(args.steps):
        seqs, mask, rewards = generate_experience(engines, step, rank)
        engines["actor"].gradient_checkpointing_enable()  # DeepSpeed-Chat: on for the update ...
        record["toggles"].append(engines["actor"].module.is_gradient_checkpointing)
        train_rlhf(engines, seqs, mask, rewards, record, args.zero_stage)
        engines["actor"].gradient_checkpointing_disable()  # ... off again before the next generation
        record["rewards"].extend(r.hex() for r in rewards.tolist())
    report(args, rank, engines, record)


# ---- models, as DeepSpeed-Chat's model_utils / lora builds them -------------------------------
def model_config() -> Qwen2Config:
    return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                       attn_implementation="eager")


def create_hf_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return Qwen2ForCausalLM(model_config())


class RewardModel(torch.nn.Module):
    """DeepSpeed-Chat's reward / critic model: a backbone and a value head."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.config = model_config()
        self.rwtransformer = Qwen2Model(self.config)
        self.v_head = torch.nn.Linear(self.config.hidden_size, 1, bias=False)

    def gradient_checkpointing_enable(self):
        self.rwtransformer.gradient_checkpointing_enable()

    def gradient_checkpointing_disable(self):
        self.rwtransformer.gradient_checkpointing_disable()

    def forward_value(self, input_ids=None, attention_mask=None, return_value_only=False,
                      use_cache=False):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask, use_cache=use_cache)[0]
        values = self.v_head(hidden).squeeze(-1)  # (B, T)
        if return_value_only:
            return values
        return {"values": values, "chosen_end_scores": values[:, -1]}


class LinearLayer_LoRA(torch.nn.Module):  # noqa: N801 -- DeepSpeed-Chat's name
    """DeepSpeed-Chat's LoRA linear: the frozen weight plus (x @ right) @ left, scaled."""

    def __init__(self, weight: torch.nn.Parameter, bias, lora_dim: int):
        super().__init__()
        self.weight, self.bias = weight, bias
        rows, columns = weight.shape
        self.lora_right_weight = torch.nn.Parameter(torch.zeros(columns, lora_dim))
        self.lora_left_weight = torch.nn.Parameter(torch.zeros(lora_dim, rows))
        torch.nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        torch.nn.init.normal_(self.lora_left_weight, std=0.02)  # non-zero: every path carries gradient
        self.lora_scaling = 1.0 / lora_dim

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + \
            (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def convert_linear_layer_to_lora(model: torch.nn.Module, lora_dim: int) -> torch.nn.Module:
    """DeepSpeed-Chat's ``convert_linear_layer_to_lora`` + ``only_optimize_lora_parameters``."""
    torch.manual_seed(SEED + 7)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child,
                    LinearLayer_LoRA(module.weight, module.bias, lora_dim))
    for name, param in model.named_parameters():
        param.requires_grad = "lora_right_weight" in name or "lora_left_weight" in name
    return model


# ---- engines, as DeepSpeed-Chat's DeepSpeedRLHFEngine builds them ---------------------------
def get_train_ds_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 1000  # norms and biases stay gathered
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
            "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 1_000_000}


def get_eval_ds_config(stage: int) -> dict:
    zero = {"stage": stage if stage == 3 else 0}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 1000
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "zero_optimization": zero,
            "steps_per_print": 1_000_000}


def create_engines(args) -> dict:
    stage = args.zero_stage
    actor_model = create_hf_model()
    if args.actor_lora_dim:
        actor_model = convert_linear_layer_to_lora(actor_model, args.actor_lora_dim)
    trained = [p for p in actor_model.parameters() if p.requires_grad]
    actor, *_ = deepspeed.initialize(model=actor_model, optimizer=torch.optim.AdamW(trained, lr=LR),
                                     config=get_train_ds_config(stage))
    reference, *_ = deepspeed.initialize(model=create_hf_model(), config=get_eval_ds_config(stage))
    ema_model = create_hf_model()
    if args.actor_lora_dim:
        ema_model = convert_linear_layer_to_lora(ema_model, args.actor_lora_dim)
    ema, *_ = deepspeed.initialize(model=ema_model, config=get_eval_ds_config(stage))
    critic_model = RewardModel(SEED + 1)
    if args.critic_gradient_checkpointing:
        critic_model.gradient_checkpointing_enable()
    critic, *_ = deepspeed.initialize(model=critic_model,
                                      optimizer=torch.optim.AdamW(critic_model.parameters(), lr=LR),
                                      config=get_train_ds_config(stage))
    reward, *_ = deepspeed.initialize(model=RewardModel(SEED + 2), config=get_eval_ds_config(stage))
    for engine in (reference, ema, reward):
        engine.eval()
    return {"actor": actor, "reference": reference, "ema": ema, "critic": critic, "reward": reward}


# ---- one iteration ----------------------------------------------------------------------------
def generate_experience(engines: dict, step: int, rank: int):
    """GROUP sampled completions of each of this rank's prompts, and their rewards."""
    actor = engines["actor"]
    actor.eval()
    gen = torch.Generator().manual_seed(SEED + 100 * step + rank)
    prompts = torch.randint(2, VOCAB, (GAS, PROMPT_LEN), generator=gen)  # (P, Tp)
    prompts = prompts.repeat_interleave(GROUP, 0)  # (P·G, Tp)
    torch.manual_seed(SEED + 100 * step + rank)
    with torch.no_grad():
        seqs = actor.module.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     synced_gpus=dist.get_world_size() > 1)  # (P·G, T)
        scores = engines["reward"].forward_value(seqs, attention_mask=torch.ones_like(seqs))
        scores = scores["chosen_end_scores"]  # (P·G,)
    actor.train()
    mask = torch.zeros_like(seqs[:, 1:], dtype=torch.float32)  # (P·G, T-1): completion tokens
    mask[:, PROMPT_LEN - 1:] = 1.0
    completions = seqs[:, PROMPT_LEN:]
    rewards = (completions % 2 == 0).float().mean(-1) + scores.float()  # (P·G,)
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


def critic_loss_fn(values, old_values, returns, mask) -> torch.Tensor:
    clipped = torch.clamp(values, old_values - CLIP, old_values + CLIP)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * (loss * mask).sum() / mask.sum()


def train_rlhf(engines: dict, seqs, mask, rewards, record, stage: int) -> None:
    actor, critic = engines["actor"], engines["critic"]
    advantages = group_advantages(rewards)
    with torch.no_grad():
        old_logp = log_probs(actor, seqs)
        ref_logp = log_probs(engines["reference"], seqs)
        old_values = critic.forward_value(seqs, return_value_only=True, use_cache=False)[:, :-1]
    returns = rewards[:, None].expand_as(mask)
    for micro in range(GAS):
        rows = slice(micro * MICRO_BATCH, (micro + 1) * MICRO_BATCH)
        loss = actor_loss_fn(log_probs(actor, seqs[rows]), old_logp[rows], ref_logp[rows], advantages[rows],
                             mask[rows])
        actor.backward(loss)
        actor.step()
        values = critic.forward_value(seqs[rows], return_value_only=True, use_cache=False)[:, :-1]
        critic_loss = critic_loss_fn(values, old_values[rows], returns[rows], mask[rows])
        critic.backward(critic_loss)
        critic.step()
        moving_average(actor, engines["ema"], zero_stage=stage)
        record["losses"].append(loss.item().hex())
        record["critic_losses"].append(critic_loss.item().hex())
        record["ds_status"].append({name: parameter_status(engines[name])
                                    for name in ("actor", "critic", "ema")})


def _z3_params_to_fetch(param_list):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def moving_average(model, model_ema, beta: float = EMA_BETA, zero_stage: int = 0) -> None:
    """DeepSpeed-Chat's ``moving_average``, as written there."""
    with torch.no_grad():
        for param, param_ema in zip(model.parameters(), model_ema.parameters()):
            params_to_fetch = _z3_params_to_fetch([param, param_ema]) if zero_stage == 3 else []
            with deepspeed.zero.GatheredParameters(params_to_fetch, enabled=len(params_to_fetch) > 0):
                param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))


def parameter_status(engine) -> dict[str, str]:
    """Every parameter's ZeRO-3 status (``AVAILABLE`` / ``NOT_AVAILABLE`` / ``INFLIGHT``)."""
    return {name: p.ds_status.name for name, p in engine.module.named_parameters() if hasattr(p, "ds_status")}


# ---- report -----------------------------------------------------------------------------------
def parameters_sha(engine) -> str:
    digest = hashlib.sha256()
    params = sorted(engine.module.named_parameters())
    gathered = [p for _, p in params if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(gathered, enabled=bool(gathered)):
        for name, param in params:
            digest.update(name.encode() + param.detach().float().numpy().tobytes())
    return digest.hexdigest()


def hilore_report(engine) -> dict | None:
    hilore = getattr(engine, "hilore", None)
    if hilore is None:
        return None
    stats = hilore.stats
    return {"enabled": hilore.enabled, "config": hilore.config.to_dict(),
            "actions": stats["actions"], "recomputed_units": stats["recomputed_units"],
            "planned": sorted(k for k, v in (stats.get("plans") or {}).items() if v is not None),
            "exposure_sources": sorted({mb["exposure_source"] or "none" for mb in stats["microbatches"]})}


def report(args, rank: int, engines: dict, record: dict) -> None:
    from tests.launch import write_result

    write_result(args.result_dir, rank, {
        "rank": rank, "world_size": dist.get_world_size(), **record,
        "classes": {name: type(engine).__name__ for name, engine in engines.items()},
        "hilore": {name: hilore_report(engine) for name, engine in engines.items()},
        "initialize_replaced": type(deepspeed.initialize).__name__ == "TrainingInitialize",
        "ds_hilore_imported": "ds_hilore" in sys.modules,
        "param_sha": {name: parameters_sha(engines[name]) for name in ("actor", "critic", "ema")},
    })


if __name__ == "__main__":
    from tests.launch import end_distributed

    main()
    end_distributed()  # NOTE [ Ending the process group ] in tests/launch.py
