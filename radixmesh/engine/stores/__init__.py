"""The stores that hold KV beyond the device: host-memory segments (the L2 tier), the storage
backends (L3) and the page mover between them; cachectl serves them, or the in-process
Engine runs them itself."""
