"""The learner's side of the syncer: session, client threads, shards, fragments in flight, the global copy."""
