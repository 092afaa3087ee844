"""The optimization stack around the dedup path: attention choice, precision, Liger, LoRA."""
