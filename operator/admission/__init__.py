"""What the API server asks before it stores a job: the spec checks, immutable fields, the webhook and its certificate."""
