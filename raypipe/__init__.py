"""raypipe: train DFlash drafters for large chat models on Ray."""

__version__ = "0.1.0"
