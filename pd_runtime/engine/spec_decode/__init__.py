"""Speculative decoding: guesses by prompt lookup (speculative.py) or a draft model
(draft_model.py), verified by the target model in one step."""
