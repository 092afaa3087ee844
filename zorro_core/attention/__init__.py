"""Attention: the hook registered in transformers, the varlen backends, padded and flex layouts."""
