"""The Decoupled DiLoCo algorithm as pure functions: fragments, codecs, merging, outer step, rounds.

Learners and the syncer share this code so both sides agree bit for bit.
"""
