"""The scheduler's world, in plain Python (no torch): block hashes and the block pool, requests, the KV cache
managers (one per attention type, a coordinator over them, the manager the scheduler asks), the KV connector's
interface, the scheduler with its policy and its plain-data output, and the drafting side of speculative
decoding. It imports only the base modules (``minipaged.config``, ``hooks``, ``utils``, ...)."""
