"""Test-side Kubernetes: an emulated API server, controllers, kopf in a thread, helm/kubectl."""

NAMESPACE = "research"  # where the operator tests create their jobs
