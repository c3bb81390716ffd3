"""What connects ds_hilore to training stacks: the DeepSpeed engine (the only module importing
DeepSpeed internals) and the zero-code-change path (autoload, ``python -m ds_hilore.run``)."""
