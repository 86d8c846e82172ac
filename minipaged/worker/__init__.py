"""What runs a step on a device: the model runner (``model_runner.py``: the forward pass) and the pieces it
uses: a step's inputs (``step_inputs.py``, over the persistent batch of ``input_batch.py`` and ``block_table.py``),
its sampling (``sampled_output.py`` over ``sampler.py``, with draft verification), the KV pool's plan
(``kv_pool_plan.py``) and device memory (``gpu_memory.py``), the cache engine that owns the KV tensors
(``cache_engine.py``); and the executors that drive one runner in this process or one per tensor-parallel rank
(``executor.py``, with the questions every rank answers in ``worker_rpc.py``). It imports the base, ``core``,
``kernels`` and ``model``."""
