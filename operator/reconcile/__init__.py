"""One pass over a job: observe (reads), plan (pure decisions), apply (writes), and the children converged."""
