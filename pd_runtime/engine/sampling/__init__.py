"""From logits to tokens: the sampler, structured-output grammars, and prompt log-probabilities."""
