"""`rollkeep bench`: benchmarks measured against docs/design.md §9, never asserted in tests."""
