"""Learners joining and rejoining: the Join, seeding before the first learner, a peer's optimizer state, pacing."""
