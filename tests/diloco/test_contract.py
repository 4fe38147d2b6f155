"""The one argv builder per process (diloco/contract.py) and the one parser each process uses
agree: every field a parent sets reaches the child's flags under the same name and value."""

from __future__ import annotations

import argparse
import dataclasses

from diloco.contract import LearnerArgs, SyncerArgs, add_learner_flags, add_syncer_flags


def parse(add_flags, argv: list[str]) -> argparse.Namespace:  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser()
    add_flags(p)
    return p.parse_args(argv)


def test_every_learner_field_round_trips_through_the_learners_flags() -> None:
    sent = LearnerArgs("job.yaml", "us", 3, "a:1,b:2", metrics_port=9100, cpus="0", host_cpus="1,2", restart=2,
                       token_file="/t", tls_ca="/ca.pem", tls_server_name="syncer", coordinator="h0:1234",
                       process_id=1, num_processes=2)
    got = vars(parse(add_learner_flags, sent.argv()))
    for field in dataclasses.fields(LearnerArgs):
        assert got[field.name] == getattr(sent, field.name), field.name


def test_every_syncer_field_round_trips_through_the_syncers_flags() -> None:
    sent = SyncerArgs("job.yaml", port=5000, metrics_port=9200, checkpoint_dir="/ck", token_file="/t",
                      tls_cert="/c.pem", tls_key="/k.pem", shard="1")
    got = vars(parse(add_syncer_flags, sent.argv()))
    for field in dataclasses.fields(SyncerArgs):
        assert got[field.name] == getattr(sent, field.name), field.name
