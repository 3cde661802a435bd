"""radixmesh: an LLM serving runtime with a radix prefix cache."""
