"""Triton kernels for the worker's GPU path, each beside a plain torch reference."""
