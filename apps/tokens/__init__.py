"""`diloco prepare-tokens`: text, Parquet or JSON Lines tokenized once into shards of ids (offline; not the learner)."""
