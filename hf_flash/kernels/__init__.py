"""Triton kernels and their host launchers. Imports nothing beyond torch and triton."""
