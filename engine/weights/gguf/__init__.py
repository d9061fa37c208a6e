"""GGUF files: the bounded reader, the model built from one, ggml block formats, writing, fixing."""
