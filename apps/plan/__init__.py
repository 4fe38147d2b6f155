"""`diloco plan`: a multi-region run sized from measured parts (docs/PLANNING.md)."""
