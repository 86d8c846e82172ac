"""What runs a step on a device: the model runner (the step's inputs, the forward pass, sampling and draft
verification), block tables, the cache engine that owns the KV tensors, and the executors that drive one runner
in this process or one per tensor-parallel rank. It imports the base, ``core``, ``kernels`` and ``model``."""
