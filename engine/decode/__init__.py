"""Generation: AR and block-diffusion loops, pure decoding policy, the prompt cache, events, limits, tokenizer, chat template."""
