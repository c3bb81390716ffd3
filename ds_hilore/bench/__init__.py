"""Measuring HiLoRe against other ways of recovering activations: small models of any
transformers architecture (``zoo``), the one-step demo and the GRPO concentration demo;
``hilore bench``: its flags and presets (``options``), GRPO-shaped data (``data``), one run and
its update (``runs``), the phases and paired rounds (``frontier``), the method registry
(``methods``), paired statistics (``paired``), the report (``summary``, ``report``, ``targets``)
and a device's exactness and memory check (``device_check``)."""
