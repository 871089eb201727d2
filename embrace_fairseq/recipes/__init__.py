"""Runnable recipes: the main job (translation to BLEU) and the language model (perplexity)."""
