"""The harness the CLI runs: benchmarks (`bench`) and workload analysis (`analyze`).

It sits above zorro_core and below zorro_cli: it imports zorro_core, never the other way, so a
trainer that imports zorro_core loads none of it (nor pandas, matplotlib, typer or rich).
"""
