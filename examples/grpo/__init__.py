"""GRPO training with DeepSpeed and ds_hilore: a DeepSpeed-Chat-step-3-style trainer.

Modules, in the order a step uses them: ``arguments`` (command line), ``task`` (data and
reward), ``model`` and ``warm_start`` (the actor), ``rollout`` (generation and scoring),
``update`` (the GRPO actor update), ``report`` (progress, JSONL, summary, plot); ``train``
puts them together, ``demo`` and ``paired`` launch it twice (gradient checkpointing and
HiLoRe) and compare.
"""
