"""What outlives a syncer incarnation: checkpoints' metadata, the publish lease, the merges learners hand back."""
