"""Solver: price the captured model on a cluster and choose a Plan.

- ``problem``: the typed inputs and outputs the others share (``WorkloadSpec``, ``MeshConfig``,
  ``LadderPolicy``, ``Constraints``, ``Assignment``); imports no other solver module.
- ``costing``: per-layer cost tables for every split strategy on a mesh (compute, collectives, memory):
  ``CostTables``.
- ``ilp``: one PuLP/CBC model per mesh candidate (strategies, stages, ladder layers, memory).
- ``stages``: balanced pipeline stage splits by the cost model's own figures (``ilp`` uses it, not
  the other way round).
- ``prediction``: the predicted latency and memory of a chosen solution.
- ``baseline``: the hand-written Megatron-LM plan an expert would run, priced the same way.
- ``explain``: each decision beside the predicted cost of its alternatives (``--why``).
- ``search``: the mesh search that drives the above and returns a ``Plan``.
"""
