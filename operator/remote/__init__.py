"""Remote parts: the home operator runs a job's learner groups in other clusters (`spec.clusters`),
writing each cluster's part with that cluster's credentials and folding its health into the home
job's status. `parts` and `health` are pure; `clients` and `sync` talk to the remote API servers.
"""
