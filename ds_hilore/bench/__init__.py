"""Measuring HiLoRe against other ways of recovering activations: small models of any
transformers architecture (``zoo``), the one-step demo and the GRPO concentration demo."""
