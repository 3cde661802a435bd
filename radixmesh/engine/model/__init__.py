"""The model side of the engine: weights, the KV pool, attention backends, sampling and the
runner that executes one step batch (a worker process, or a thread of the in-process Engine)."""
