"""Weights on disk and in memory: formats, checkpoint reading, quantization and its cache, GGUF."""
