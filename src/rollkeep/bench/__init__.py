"""`rollkeep bench`: benchmarks measured against DESIGN.md §13, never asserted in tests."""
