"""What the course adds to experiment with the engine: workloads, the contiguous allocator vLLM replaced, the
simulator (the real scheduler on a cost model's clock) and the checking driver the tests fuzz the scheduler
with. It imports the engine and below; ``serving`` beside it is not imported."""
