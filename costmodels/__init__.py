"""Cost models: pure functions of shapes, dtype, placement and a cluster spec (SI units inside).

- ``cluster``: YAML cluster specs (presets in ``costmodels/clusters/``) -> ``ClusterSpec``.
- ``compute``: per-op time by roofline, FLOP and byte counts of common ops.
- ``comm``: alpha-beta collectives, hierarchical across nodes with NICs shared per node.
- ``memory``: weights, gradients, Adam state, activations, KV cache per rank.
- ``calibrate``: measure this machine (``planner calibrate``) and write a spec.
"""
