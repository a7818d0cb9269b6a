"""Measuring tensors: which are measurable, the reducers, their numerics, histograms, transfer."""

__all__: list[str] = []
