"""Our own compute kernels for inference on the CPU: C code (``native/``) compiled on first use
for this CPU and called through ctypes, where torch's kernels cost more in calls than in work."""
