"""Measuring HiLoRe against other ways of recovering activations: small models of any
transformers architecture (``zoo``), the one-step demo and the GRPO concentration demo;
``hilore bench`` (``frontier``, its method registry in ``methods``): throughput, peak memory and
gradient error of every activation method per memory budget, as a table, JSON and a plot."""
