"""Measuring HiLoRe against other ways of recovering activations: small models of any
transformers architecture (``zoo``), the GRPO concentration demo (``grpo_demo``);
``hilore bench`` (``bench``: the pipeline), read in its order: the flags (``options``), the
ranks it launches (``launch``, ``link``, ``rank``) with their model (``models``), GRPO data
(``data``), engines (``engines``; the method registry: ``methods``) and schedules (``rounds``,
``wholerun``; HiLoRe's stats read in ``stats``), the report document (``summary``; paired
statistics: ``paired``; the targets: ``targets``) and its output (``report``); and a device's
exactness and memory check (``device_check``)."""
