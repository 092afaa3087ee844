"""The proof: the independent per-sequence reference, gradient and training checks, planted bugs."""
