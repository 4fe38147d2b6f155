"""Fault-injection helpers: a loopback TCP proxy that misbehaves on demand, and a cluster of
real syncer and learner processes to break (tests/faults/test_faults.py, tests/system/test_prometheus.py)."""
