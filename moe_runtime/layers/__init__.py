"""Stateless layer functions over packed token tensors ``[T, ...]`` (T = tokens in the step)."""
