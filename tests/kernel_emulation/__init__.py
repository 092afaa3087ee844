"""CPU emulations of the compiled flash kernels, keeping their memory contract (see flash_core)."""
