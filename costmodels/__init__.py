"""Cost models: pure functions of shapes, dtype, placement and a cluster spec (SI units inside).

- ``cluster``: YAML cluster specs (presets in ``costmodels/clusters/``) -> ``ClusterSpec``.
- ``compute``: per-op time by roofline, FLOP and byte counts of common ops.
- ``comm``: alpha-beta collectives, hierarchical across nodes with NICs shared per node.
- ``memory``: weights, gradients, Adam state, activations, KV cache per rank.
- ``context_parallel``: an attention core split over context-parallel ranks (ring, all-gather,
  all-to-all; load balancing): kernels, exposed and hidden traffic, K/V buffers.
- ``calibrate``: measure this machine (``planner calibrate``) and write a spec.
"""
