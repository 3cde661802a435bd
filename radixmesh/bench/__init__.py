"""`radixmesh bench`: a serving benchmark for radixmesh and any OpenAI-compatible server."""
