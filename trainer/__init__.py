"""The learner: a Flax transformer LM on its own data shard, running the Decoupled DiLoCo loop."""
