"""`zorro analyze`: a workload's shared tokens and ideal speedups, from shapes or from a dataset."""
