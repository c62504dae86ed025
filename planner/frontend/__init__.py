"""Front end: load a model file, capture it as an ATen-level fx graph, and analyse its structure.

- ``modelfile``: load ``build_model()`` / ``example_inputs()`` from a user's Python file.
- ``capture``: ``torch.export`` (non-strict) -> ``fx.GraphModule`` with shapes in ``node.meta``.
- ``analysis``: dataflow analysis -> ``ModelStructure`` (layers, projections, roles, node costs).
- ``moe``: a layer's mixture-of-experts block (router, routed and shared experts, dispatch, combine).
- ``roles``: ``Role`` and ``Projection``, shared by ``analysis`` and ``moe``.
- ``depth``: plan deep models through a representative slice of their layers.
"""
