"""The KV tiers beyond the device: host-memory segments (L2) and the storage backends (L3),
with the page mover between them (served by cachectl, or run in-process by the Engine)."""
