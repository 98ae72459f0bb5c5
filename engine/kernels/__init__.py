"""Optional compiled kernels; every caller keeps a plain-torch twin that gives the same result."""
