"""ladle: training recipes for large language models on any PyTorch accelerator."""

__version__ = "0.1.0"
