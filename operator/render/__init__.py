"""Pure `spec -> manifests`: every child the operator creates for a job, as plain dicts."""
