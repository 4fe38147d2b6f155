"""Kueue's part: the operator is the job integration for DecoupledDiLoCoJobs (Workloads, admission, slices, eviction)."""
