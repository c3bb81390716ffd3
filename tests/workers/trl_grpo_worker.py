"""Worker for tests/test_trl.py: TRL's GRPOTrainer, unchanged, on CPU ranks under DeepSpeed.

The script is what a TRL user runs: a model directory, a dataset of prompts, a reward
function, ``GRPOConfig(deepspeed=ds_config.json, gradient_checkpointing=True, beta)``
and ``trainer.train()`` (``--beta``: 0.04 by default, so a reference model exists; 0 leaves
every loss term a multiple of the advantage, so HiLoRe gets the exposure before the forward).
Nothing in it names ds_hilore: HiLoRe comes in, or not, through the environment
(DS_HILORE / DS_HILORE_CONFIG) and the ds_config. A GRPOTrainer subclass only
records each micro-step's loss (``compute_loss`` unchanged).

Each rank reports TRL's log history (loss, grad_norm, reward, kl per step), the micro-step
losses and the SHA-256 of the final parameters, which engine classes the policy and the
reference model got, and the policy's HiLoRe stats.

``build_model_dir(path)`` writes the tiny model and tokenizer (no download): a word-level
tokenizer made with ``tokenizers`` and a 2-layer Qwen2 with random weights.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(61)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10 w11", "w12 w13 w14", "w15", "w16 w17", "w18 w19 w20"]


def build_model_dir(path: str | Path) -> None:
    """A tokenizer and a tiny Qwen2 (2 layers, hidden 32) with random weights, saved to ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def reward_even_words(completions, **kwargs) -> list[float]:
    """Share of words with an even index: varies within a group, so advantages are not all 0."""
    rewards = []
    for text in completions:
        words = [w for w in text.split() if w.startswith("w") and w[1:].isdigit()]
        rewards.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed runner passes it
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--beta", type=float, default=0.04)  # 0: no KL term, no reference model
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int)
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    class RecordingGRPOTrainer(GRPOTrainer):
        micro_losses: list[str] = []

        def compute_loss(self, *a, **kw):
            loss = super().compute_loss(*a, **kw)
            self.micro_losses.append(float(loss.detach()).hex())
            return loss

    training_args = GRPOConfig(
        output_dir=str(Path(args.result_dir) / "out"), deepspeed=args.deepspeed, max_steps=args.steps,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=6, learning_rate=1e-2, beta=args.beta, gradient_checkpointing=True,
        logging_steps=1, save_strategy="no", report_to="none", seed=7, use_cpu=True,
        bf16=False, dataloader_num_workers=0, model_init_kwargs={"dtype": "float32"})
    trainer = RecordingGRPOTrainer(model=args.model_dir, reward_funcs=reward_even_words, args=training_args,
                                   train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                   processing_class=PreTrainedTokenizerFast.from_pretrained(args.model_dir),
                                   callbacks=[_PredictedPerStep()])
    trainer.train()
    report(trainer, args.result_dir)


def _PredictedPerStep():
    """A callback recording, after every optimizer step, how many of its microbatches HiLoRe
    planned from an exposure predicted before the forward (``stats["predicted_microbatches"]``)."""
    from transformers import TrainerCallback

    class PredictedPerStep(TrainerCallback):
        counts: list[int] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            runtime = sys.modules["ds_hilore"].find_runtime(model) if "ds_hilore" in sys.modules else None
            self.counts.append(None if runtime is None else runtime.stats.get("predicted_microbatches"))

    return PredictedPerStep()


def report(trainer, result_dir: str) -> None:
    import deepspeed
    import torch.distributed as dist

    from tests.launch import write_result

    engine, ref = trainer.model_wrapped, trainer.ref_model
    digest = hashlib.sha256()
    for name, param in sorted(engine.module.named_parameters()):
        digest.update(name.encode() + param.detach().float().numpy().tobytes())
    hilore = getattr(engine, "hilore", None)
    write_result(result_dir, dist.get_rank(), {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "engine_class": type(engine).__name__,
        "ref_engine_class": type(ref).__name__ if ref is not None else None,
        "ref_hilore": _has_hilore(ref),
        "initialize_replaced": type(deepspeed.initialize).__name__ == "TrainingInitialize",
        "ds_hilore_imported": "ds_hilore" in sys.modules,
        "loss_step_wrapped": getattr(type(trainer)._compute_loss, "_ds_hilore_exposure", False),
        "hilore_stats": None if hilore is None else _plain(hilore.stats),
        "hilore_force_plan": None if hilore is None else hilore.config.force_plan,
        "log_history": [{k: v for k, v in entry.items() if isinstance(v, (int, float))}
                        for entry in trainer.state.log_history],
        "micro_losses": trainer.micro_losses,
        "predicted_per_step": next((c.counts for c in trainer.callback_handler.callbacks
                                    if type(c).__name__ == "PredictedPerStep"), None),
        "param_sha": digest.hexdigest(),
    })


def _has_hilore(engine) -> bool | None:
    """Whether HiLoRe is attached to an engine or its module (None: no engine)."""
    if engine is None:
        return None
    if getattr(engine, "hilore", None) is not None:
        return True
    if "ds_hilore" not in sys.modules:
        return False
    from ds_hilore import find_runtime

    return find_runtime(engine.module) is not None


def _plain(value):
    """JSON-safe copy of a stats dict (tuples become lists, other objects their repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


if __name__ == "__main__":
    from tests.launch import end_distributed

    main()
    end_distributed()  # NOTE [ Ending the process group ] in tests/launch.py
