"""The built-in model (a tiny GPT) and its character tokenizer."""
