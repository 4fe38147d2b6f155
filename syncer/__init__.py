"""The syncer: a CPU gRPC service that merges learners' outer gradients into the global model."""
