"""bootseer: fast, safe restarts for large PyTorch training jobs."""

__version__ = "0.1.0"
