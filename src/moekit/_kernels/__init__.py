"""Every ``@triton.jit`` function in moekit lives in this package and nowhere else."""
