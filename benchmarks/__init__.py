"""Side-by-side benchmarks against peers."""
