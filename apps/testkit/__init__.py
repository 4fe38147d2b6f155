"""Test and benchmark infrastructure that ships with the package (used by tests and bench/)."""
