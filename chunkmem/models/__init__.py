"""Small reference models used by the demo, the tests and the benchmarks."""
