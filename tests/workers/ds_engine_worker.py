"""Worker for tests/test_engine_distributed.py: train a tiny model under DeepSpeed on CPU ranks.

Run by tests.launch.run_distributed (ranks started directly, the deepspeed runner or mpirun).
Each ``--case`` is
``<config>:<model>:<mode>[:<loss>]``:

* config: a file of ds_configs/ without ``.json`` (``zero2_hilore``, ``zero3_lora_hilore``, ...)
* model: ``full`` (every parameter trains) or ``lora`` (peft LoRA on every linear layer)
* mode: ``gc`` = the file without its "hilore" block and transformers' gradient
  checkpointing on (the baseline); ``H`` / ``L`` / ``R`` = HiLoRe with that force_plan;
  ``mixed`` = layer 0 H, the rest R; ``auto`` = HiLoRe as the file configures it; ``split``
  = as ``auto`` with the tiny model's slices packable, and every unit of the bucket's plan a
  per-sequence split (S) once it is built from the profile; on rank 0 only, the first run it
  packs in micro-step ``OVERFLOW_AT`` reports a non-finite norm (``OverflowOnce``).
* loss: ``lm`` (causal LM loss, default) or ``grpo_rank0_only`` (GRPO loss through
  ds_hilore.grpo; every advantage on rank 1 is 0, so its ω is zero everywhere).

A case that raises is reported as ``{"error": traceback}`` and the next case runs (an error
on one rank only leaves the other waiting in a collective: the launch's timeout ends it).
Each case trains ``--steps`` optimizer steps (gradient accumulation from the config) and
reports the losses of every micro-step as float.hex, the SHA-256 of every final parameter,
the max |difference| to the case ``<config-family>:<model>:gc`` run earlier in the same
launch, and HiLoRe's unit actions, stats and plan hash per step. Data and dropout are
seeded per (step, micro-step, rank), so a resumed run sees what an uninterrupted one saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.launch import write_result
from tests.models import equal_utilities, gc_timed_slower

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "ds_configs"
SEED = 1234
VOCAB, SEQ = 128, 16
# mode -> hilore.force_plan ("gc": no hilore block; "auto": the file's own block)
FORCE_PLANS = {"H": "H", "L": "L", "R": "R", "mixed": {"*": "R", "model.layers.0.*": "H"}}
MODES = ("gc", "auto", "split", *FORCE_PLANS)
# "split": (B, T, 32) rows of 512 elements packable; a risk budget below rank 0's risk of packing
# every split (0.009-0.012 of the step's gradient), so that the risk fit sends its riskiest
# units to R -- on rank 1 too, whose own risk is 0 (its ω is)
SPLIT_BLOCK = {"min_pack_numel": 64, "codec_backend": "eager", "grad_error_tolerance": 0.006}
OVERFLOW_AT = (3, 0)  # (step, micro-step) of "split": planned, and nothing recomputed there else
RECOMPUTED: list = []  # the units each layer recompute of the current micro-step re-ran
NOW = {"step": 0, "micro": 0}  # the micro-step ``train`` runs
LOSSES = ("lm", "grpo_rank0_only", "grpo_entropy_rank1_zero")


@dataclass(frozen=True)
class Case:
    config: str  # file name in ds_configs/ without .json
    model: str  # "full" | "lora"
    mode: str  # one of MODES
    loss: str = "lm"

    @classmethod
    def parse(cls, text: str) -> "Case":
        case = cls(*text.split(":"))
        assert case.model in ("full", "lora") and case.mode in MODES and case.loss in LOSSES, text
        return case

    @property
    def name(self) -> str:
        return ":".join((self.config, self.model, self.mode) + (() if self.loss == "lm" else (self.loss,)))

    @property
    def reference(self) -> str:
        """The GC baseline case with the same ZeRO config and model (ZeRO-2 has its own file)."""
        config = "zero2_gc_baseline" if self.config.startswith("zero2") else self.config
        return Case(config, self.model, "gc", self.loss).name


# ---- setup ------------------------------------------------------------------------------
def ds_config(case: Case) -> dict:
    config = json.loads((CONFIG_DIR / f"{case.config}.json").read_text())
    if case.mode == "gc":
        config.pop("hilore", None)
    elif case.mode == "split":
        config["hilore"].update(SPLIT_BLOCK)
    elif case.mode != "auto":
        config["hilore"]["force_plan"] = FORCE_PLANS[case.mode]
    return config


def build_model(model: str, gc: bool) -> torch.nn.Module:
    """The tiny Qwen2 (``model="full"``) or it with peft LoRA (``"lora"``); ``gc``: HF GC on."""
    torch.manual_seed(SEED)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64, attention_dropout=0.1,
                         attn_implementation="eager", use_cache=False)
    lm = Qwen2ForCausalLM(config)
    if model == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        lm = get_peft_model(lm, lora)
    if gc:
        # The baseline: transformers' own (non-reentrant) gradient checkpointing.
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    return lm


def make_engine(case: Case, port: int):
    import ds_hilore.integrations.engine

    model = build_model(case.model, gc=case.mode == "gc")
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_hilore.integrations.engine.initialize(model=model, model_parameters=params,
                                             config=ds_config(case), distributed_port=port)
    if case.mode == "split":
        plan_splits(engine.hilore.policy, lambda name: "S")
        engine.hilore._codec = OverflowOnce(engine.hilore._codec, armed=dist.get_rank() == 0)
    return engine


class OverflowOnce:
    """The runtime's codec, but where ``armed`` (one rank) the first run it packs in micro-step
    ``OVERFLOW_AT`` reports a non-finite norm, as a run that overflowed on that rank's data
    would (an fp16 activation past its range): its unit must go to R on every rank (NOTE
    [ Collective fallback ]), or ZeRO-3's gathers of the recompute differ. The payload is
    intact: the recompute that replaces it is exact either way."""

    def __init__(self, inner, armed: bool):
        self.inner, self.armed = inner, armed

    def pack_async(self, x, measure=True):
        packed = self.inner.pack_async(x, measure)
        if self.armed and (NOW["step"], NOW["micro"]) == OVERFLOW_AT:
            self.armed = False
            inf = torch.full_like(packed.stats[1], float("inf"))
            packed = dataclasses.replace(packed, stats=torch.stack([packed.stats[0], inf]))
        return packed

    def unpack(self, packed, out=None):
        return self.inner.unpack(packed, out=out)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def plan_splits(scheduler, action_of) -> None:
    """The bucket's plan, once built from the profile, becomes ``action_of(unit name)`` for
    every unit (the same on every rank; the knapsack's prices are kept)."""
    plan_bucket = scheduler._plan_bucket

    def planned(bucket, profiled=True):
        plan_bucket(bucket, profiled)
        bucket.plan = dataclasses.replace(bucket.plan, actions={
            name: action_of(name) for name in bucket.plan.actions})

    scheduler._plan_bucket = planned


def record_recomputes(log: list) -> None:
    """Every layer recompute appends to ``log`` the names of the units it re-runs: what a rank
    gathers under ZeRO-3, in the order it gathers it."""
    from ds_hilore.runtime.bundle import LayerFrame

    recompute = LayerFrame._recompute

    def recorded(frame, trigger):
        need = {trigger} | {p for p, unit in enumerate(frame.units)
                            if any((s := r()) is not None and s.empty() and not s.consumed
                                   for r in unit.slots)}
        log.append(sorted(frame.layer.units[p].name for p in need))
        return recompute(frame, trigger)

    LayerFrame._recompute = recorded


# ---- one micro-step ---------------------------------------------------------------------
def micro_batch(step: int, micro: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=gen)  # (B, T) token ids


def lm_loss(engine, ids: torch.Tensor, rank: int) -> torch.Tensor:
    return engine(input_ids=ids, labels=ids).loss


def grpo_rank0_only_loss(engine, ids: torch.Tensor, rank: int) -> torch.Tensor:
    from ds_hilore.grpo import policy_loss

    logits = engine(input_ids=ids).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    adv = torch.tensor([1.0, -1.0]) if rank == 0 else torch.zeros(2)  # (B,)
    mask = torch.ones_like(logp, dtype=torch.bool)  # (B, T-1)
    return policy_loss(logp, None, adv, mask, loss_type="grpo", model=engine.module).loss


def grpo_entropy_rank1_zero_loss(engine, ids: torch.Tensor, rank: int) -> torch.Tensor:
    """A = 0 on rank 1 only, plus an entropy bonus that ω does not see: rank 1's elided
    sequences receive gradient, so its H layers must fall back to R -- on both ranks."""
    from ds_hilore.grpo import policy_loss

    logits = engine(input_ids=ids).logits.float()  # (B, T, V)
    logprobs = torch.log_softmax(logits[:, :-1], -1)  # (B, T-1, V)
    logp = logprobs.gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    adv = torch.tensor([1.0, -1.0]) if rank == 0 else torch.zeros(2)  # (B,)
    mask = torch.ones_like(logp, dtype=torch.bool)  # (B, T-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1).mean()
    return policy_loss(logp, None, adv, mask, loss_type="grpo", model=engine.module).loss \
        - 0.01 * entropy


LOSS_FUNCTIONS = {"lm": lm_loss, "grpo_rank0_only": grpo_rank0_only_loss,
                  "grpo_entropy_rank1_zero": grpo_entropy_rank1_zero_loss}


# ---- recording --------------------------------------------------------------------------
def full_parameters(engine) -> dict[str, torch.Tensor]:
    """Every parameter, gathered (ZeRO-3) and copied, by name."""
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {name: p.detach().clone() for name, p in named}


def digest(obj) -> str:
    """Order-stable SHA-256 of nested dicts/lists/tensors/scalars (for state comparisons)."""
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"[{len(x)}".encode())
            for item in x:
                feed(item)
        elif isinstance(x, torch.Tensor):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(x).encode())

    feed(obj)
    return h.hexdigest()


def hilore_record(engine) -> dict | None:
    runtime = engine.hilore
    if runtime is None:
        return None
    stats = runtime.stats
    return {"unit_names": [u.name for u in runtime.units], "unit_actions": [u.action for u in runtime.units],
            "plan_hash": runtime.plan_hash(), "actions": dict(stats.get("actions", {})),
            "recomputed_units": stats.get("recomputed_units"),
            "nonfinite_slices": stats.get("nonfinite_slices")}


# ---- a case -----------------------------------------------------------------------------
def train(engine, loss: str, first_step: int, last_step: int, rank: int, record: dict) -> None:
    """Optimizer steps ``first_step..last_step``; appends to record["losses"] / ["steps"]."""
    loss_fn = LOSS_FUNCTIONS[loss]
    for step in range(first_step, last_step + 1):
        for micro in range(engine.gradient_accumulation_steps()):
            torch.manual_seed(SEED + 1000 * step + 10 * micro + rank)  # dropout masks
            del RECOMPUTED[:]
            NOW.update(step=step, micro=micro)
            value = loss_fn(engine, micro_batch(step, micro, rank), rank)
            engine.backward(value)
            engine.step()
            record["losses"].append(value.item().hex())
            record.setdefault("recomputed", []).append(list(RECOMPUTED))
        record["steps"].append({"global_steps": engine.global_steps, "hilore": hilore_record(engine)})


def run_case(case: Case, args, references: dict) -> dict:
    start = time.perf_counter()
    print(f"[ds_engine_worker] case {case.name}", flush=True)  # locates a failure in the output
    engine = make_engine(case, args.master_port)
    rank = dist.get_rank()  # known once DeepSpeed initialised (under mpirun: by MPI discovery)
    record = {"losses": [], "steps": [], "hilore_enabled": engine.hilore is not None,
              "engine_class": type(engine).__name__,
              "collective_class": type(getattr(engine.hilore, "collective", None)).__name__}
    initial = full_parameters(engine)
    first = 1
    if args.resume_from:
        load_path, client_state = engine.load_checkpoint(_ckpt_dir(args.resume_from, case), tag="saved")
        record["resumed"] = {"load_path": str(load_path), "global_steps": engine.global_steps,
                             "client_state": sorted(client_state), "extra": client_state.get("extra")}
        if engine.hilore is not None:
            record["resumed"]["hilore_state"] = digest(engine.hilore.state_dict())
        first = engine.global_steps + 1
    for step in range(first, args.steps + 1):
        train(engine, case.loss, step, step, rank, record)
        if args.save_at == step:
            engine.save_checkpoint(_ckpt_dir(args.save_to, case), tag="saved", client_state={"extra": step})
            if engine.hilore is not None:
                record["saved_hilore_state"] = digest(engine.hilore.state_dict())
    final = full_parameters(engine)
    record["param_sha"] = {name: digest(t) for name, t in final.items()}
    record["changed"] = sorted(n for n in final if not torch.equal(final[n], initial[n]))
    reference = references.get(case.reference)
    if reference is not None and case.name != case.reference:
        record["max_abs_diff_vs_reference"] = max(
            (final[n] - reference[n]).abs().max().item() for n in final)
    references[case.name] = final
    record["seconds"] = time.perf_counter() - start
    engine.destroy()
    return record


def check_collective() -> dict:
    """ds_hilore's collective used directly: rank 0 decides, maxima and sums over ranks."""
    from ds_hilore.integrations.engine import TorchDistCollective

    c = TorchDistCollective()
    mine = ["H", "L", "R"] if c.rank == 0 else ["R", "R", "R"]
    return {"rank": c.rank, "world_size": c.world_size, "broadcast": c.broadcast_actions(mine),
            "max": c.all_reduce_max([c.rank, 2**40 if c.rank == 0 else 5]),
            "sum": c.all_reduce_sum([0.5, 0.25]),
            # gathered and summed here (NOTE [ Host values gathered ]): the same bits on both
            # ranks (the order of three or more is tests/test_engine.py's); a list longer than
            # _GATHER_MAX goes by an all-reduce
            "ordered": c.all_reduce_sum([0.1 if c.rank == 0 else 0.2, 1e16 if c.rank == 0 else 1.0]),
            "long": c.all_reduce_max_float([float(c.rank)] * 2000)}


def _ckpt_dir(root: str, case: Case) -> str:
    return os.path.join(root, case.name.replace(":", "_"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", required=True, type=Case.parse)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save_at", type=int, default=0)
    parser.add_argument("--save_to", default=None)
    parser.add_argument("--resume_from", default=None)
    parser.add_argument("--check_collective", action="store_true")
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed runner passes it
    args = parser.parse_args()
    record_recomputes(RECOMPUTED)
    started = time.perf_counter()
    results, references = {}, {}
    for case in args.case:
        fixed = pytest.MonkeyPatch()
        if case.mode == "auto":
            # fixed times: H pays for every unit whatever the load, so the plan (and the test's
            # "H" in it) does not depend on how busy the machine is
            equal_utilities(fixed)
            gc_timed_slower(fixed)
        try:
            results[case.name] = run_case(case, args, references)
        except Exception:  # reported per case; a rank left waiting in a collective hits the timeout
            traceback.print_exc()
            results[case.name] = {"error": traceback.format_exc()}
        finally:
            fixed.undo()
    rank = dist.get_rank()
    payload = {"rank": rank, "world_size": dist.get_world_size(), "cases": results,
               "seconds": time.perf_counter() - started, "backend": dist.get_backend()}
    if args.check_collective:
        payload["collective"] = check_collective()
    write_result(args.result_dir, rank, payload)


if __name__ == "__main__":
    from tests.launch import end_distributed

    main()
    end_distributed()  # NOTE [ Ending the process group ] in tests/launch.py
