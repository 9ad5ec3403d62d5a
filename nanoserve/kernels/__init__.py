"""Native CPU kernels: C source compiled once per machine at first use (build.py), bound with ctypes (fused.py)."""
