"""What every service may import: the domain types the services exchange (sampling
parameters, finish reasons, the step batch and its result), the model's files and its
tokenizer. Nothing here speaks a transport."""
