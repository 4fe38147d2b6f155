"""Pure status logic: phase, conditions, goodput, and when a job ends."""
