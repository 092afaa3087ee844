"""The `zorro` command line."""
