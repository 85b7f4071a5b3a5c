"""mnn_runtime: serve every live version of an MNN model, split traffic by a stable hash."""

__version__ = "0.1.0"
