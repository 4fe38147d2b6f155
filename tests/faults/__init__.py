"""Fault-injection helpers: a loopback TCP proxy that misbehaves on demand, and a cluster of
real syncer and learner processes to break (tests/test_faults.py, tests/test_prometheus.py)."""
