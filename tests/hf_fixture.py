"""The tiny offline transformers model of the hf engine, trainer and server-mode tests
(`rollkeep.models.tiny_hf`)."""

from rollkeep.models.tiny_hf import CHARS, CHAT_TEMPLATE, SPECIALS, make_tiny_hf_model

__all__ = ["CHARS", "CHAT_TEMPLATE", "SPECIALS", "make_tiny_hf_model"]
