"""The engine library: what one engine replica runs, in one process or spread over the mesh.

Scheduling side (no tensors, no transport): `request` (the engine's `Req`), `scheduler`
(admission, chunked prefill, decode, retraction; its knobs in `scheduler_config`) and its
collaborators `schedule_policy`, `constraints` (compile gating, jump-forward), `speculation`
(n-gram drafts) and `tiering` (the tiers behind the device pool); `radix_cache` over
`tree_node`, `eviction`, `kv_allocator`; the host and storage tiers' bookkeeping
(`host_tier`, `storage_tier`, `host_link`); and `loop` (the engine loop over an executor
and a sink).
`model/` runs a step on the weights; `stores/` holds the host KV pool and the storage backends.
The in-process `radixmesh.Engine` and the scheduler, worker and cachectl services are fronts
over this package; it imports none of them and no protobuf."""
