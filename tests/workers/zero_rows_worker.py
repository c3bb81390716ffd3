"""Worker for tests/test_zero_rows.py: GRPO micro-steps under DeepSpeed ZeRO-2 / ZeRO-3 on 2 CPU
ranks whose zero sequences differ by rank (NOTE [ A backward of zeros ] in
ds_hilore/runtime/zero_backward.py, NOTE [ Kept rows only ] in ds_hilore/runtime/rows.py).

Each ``--case`` is ``<stage>:<mode>``: stage ``zero2`` or ``zero3``; mode ``gc`` (no HiLoRe,
transformers' checkpointing: the reference), ``skip`` (HiLoRe all R, no prediction: a rank whose
microbatch is all zero may skip its layers' backward), ``noskip`` (the same with the skip
switched off), ``predict_R`` / ``predict_H`` (that plan, the prediction handed to ``expect``
before each forward: rows run apart). Every case trains ``STEPS`` optimizer steps of ``GAS``
micro-steps of ``B`` sequences; advantages per (rank, micro-step) are ``ADVANTAGES``: rank 1's
first micro-step is all zero while rank 0's is not, and the zero rows differ by rank. Reports
the losses (float.hex), the SHA-256 of every final parameter and, per micro-step, whether its
layers' backward was skipped and which rows ran with autograd.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.launch import case_arguments, run_cases
from tests.workers.ds_engine_worker import digest, full_parameters

REPO_ROOT = Path(__file__).resolve().parents[2]
SEED, VOCAB, B, T, GAS, STEPS = 4321, 128, 4, 16, 2, 3
ADVANTAGES = {0: ([1.0, 0.0, -1.0, 0.0], [1.0, -1.0, 0.5, -0.5]),
              1: ([0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, -1.0])}  # rank -> per micro-step
MODES = ("gc", "skip", "noskip", "predict_R", "predict_H")
CASES = [f"{stage}:{mode}" for stage in ("zero2", "zero3") for mode in MODES]


def ds_config(stage: str, mode: str) -> dict:
    config = json.loads((REPO_ROOT / "ds_configs" / f"{stage}_hilore.json").read_text())
    config["train_micro_batch_size_per_gpu"] = B
    config["gradient_accumulation_steps"] = GAS
    if mode == "gc":
        config.pop("hilore")
    else:
        config["hilore"] = {"force_plan": "H" if mode == "predict_H" else "R",
                            "low_precision": "none"}
    return config


def build_model(gc: bool) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64, attention_dropout=0.0,
                         attn_implementation="eager", use_cache=False)
    model = Qwen2ForCausalLM(config)
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def micro_step(engine, step: int, micro: int, rank: int, predict: bool) -> torch.Tensor:
    from ds_hilore.grpo import policy_loss

    gen = torch.Generator().manual_seed(SEED + 1000 * step + 10 * micro + rank)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)  # (B, T)
    adv = torch.tensor(ADVANTAGES[rank][micro])  # (B,)
    if predict:
        engine.hilore.expect([abs(a) for a in adv.tolist()])
    logits = engine(input_ids=ids).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    mask = torch.ones_like(logp, dtype=torch.bool)
    return policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", model=engine.module).loss


def run(case: str, port: int) -> dict:
    import ds_hilore.integrations.engine

    stage, mode = case.split(":")
    model = build_model(gc=mode == "gc")
    engine, *_ = ds_hilore.integrations.engine.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(stage, mode), distributed_port=port)
    if mode == "noskip":
        engine.hilore.zero_backward_skip = False
    rank, record = dist.get_rank(), {"losses": [], "skipped": [], "kept_rows": []}
    for step in range(STEPS):
        for micro in range(GAS):
            loss = micro_step(engine, step, micro, rank, mode.startswith("predict"))
            engine.backward(loss)
            engine.step()
            record["losses"].append(loss.item().hex())
        if engine.hilore is not None:
            for mb in engine.hilore.stats["microbatches"]:
                record["skipped"].append(mb["backward_skipped"])
                record["kept_rows"].append(mb["kept_rows"])
    record["param_sha"] = {name: digest(p) for name, p in full_parameters(engine).items()}
    engine.destroy()
    return record


def main() -> None:
    args = case_arguments(CASES)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ds_hilore").setLevel(logging.INFO)
    run_cases("zero_rows_worker", args.case, lambda case: run(case, args.master_port),
              args.result_dir)


if __name__ == "__main__":
    main()
