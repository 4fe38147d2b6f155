"""Θ₀ from the first learner (syncer/joins/seeding.py): a syncer without a checkpoint runs no model
code; the first learner seeds it, later learners must start from the same Θ₀, and a bad seed
changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from diloco.checkpoint import CheckpointStore
from diloco.core.codecs import bundle_size
from diloco.core.fragments import plan_fragments, specs_from_shapes
from diloco.core.seed import InitialModel, seed_hash
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.acceptance import Refused
from diloco.syncer.core import SyncerCore
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.joins.seeding import Switch, Unseeded, receive_seed, seeded_model
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.servicer import SyncerServicer
from diloco.trainer.sync.client import JoinRefused, SyncerClient
from diloco.wire import (
    add_syncer,
    auth_metadata,
    parse_unseeded,
    pb,
    rpc,
    seed_chunks,
    server_options,
    unseeded_message,
)
from tests import syncer_harness as sh
from tests.helpers import without_learner_extra

SPEC = SyncerSpec(fragments=2)


def initial(seed: int = 0, spec: SyncerSpec = SPEC) -> InitialModel:
    plan = plan_fragments(specs_from_shapes(sh.SHAPES), spec.plan_size, spec.fragmentation)
    return InitialModel(sh.params(seed), plan.fragments)


@pytest.fixture
def unseeded(tmp_path: Path) -> Iterator[tuple[str, Unseeded, Switch]]:
    """An unseeded syncer on loopback, switched to the syncer proper when seeded (as serve does)."""
    store = CheckpointStore(tmp_path / "ckpt")

    def start(model: GlobalModel) -> SyncerCore:
        core = SyncerCore(spec=SPEC, model=model, store=store, metrics=SyncerMetrics(), tokens_per_step=sh.TOKENS_PER_STEP)
        core.checkpoint()
        switch.current = SyncerServicer(core, sh.TOKEN)
        return core

    gate = Unseeded(SPEC, 0, sh.TOKEN, on_seed=start)
    switch = Switch(gate)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=server_options())
    add_syncer(switch, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", gate, switch
    server.stop(0)


def test_the_first_learner_seeds_and_the_next_must_start_from_the_same_model(unseeded, tmp_path: Path) -> None:
    address, gate, switch = unseeded
    first = SyncerClient(address, sh.TOKEN, "a-0", "r")
    state = first.join_with_retry(dict(sh.SHAPES), initial(0))
    assert gate.seeded.is_set() and isinstance(switch.current, SyncerServicer)
    assert all(np.array_equal(state.params[n], sh.params(0)[n]) for n in sh.SHAPES)  # Θ₀ as the learner had it
    assert gate.model is not None and gate.model.init_hash == seed_hash(sh.params(0))
    second = SyncerClient(address, sh.TOKEN, "a-1", "r")
    second.join_with_retry(dict(sh.SHAPES), initial(0))  # the same Θ₀: admitted, and seeds nothing
    other = SyncerClient(address, sh.TOKEN, "a-2", "r")
    with pytest.raises(JoinRefused, match="initial model Θ₀ differs"):
        other.join_with_retry(dict(sh.SHAPES), initial(1))  # another spec.data.seed
    # The hash is in the first checkpoint: a restored syncer holds learners to the same Θ₀.
    loaded, _ = CheckpointStore(tmp_path / "ckpt").load_latest()
    assert loaded is not None
    restored = GlobalModel.from_state(SPEC, loaded.arrays, loaded.meta)  # shapes from the checkpoint itself
    assert restored.init_hash == gate.model.init_hash and restored.shapes() == gate.model.shapes()
    for c in (first, second, other):
        c.close()


def test_a_client_without_an_initial_model_is_told_the_syncer_needs_one(unseeded) -> None:
    address, gate, _ = unseeded
    client = SyncerClient(address, sh.TOKEN, "a-0", "r")
    with pytest.raises(JoinRefused, match="unseeded shard 0 of 1"):
        client.join_with_retry(dict(sh.SHAPES))
    assert not gate.seeded.is_set()
    client.close()
    with grpc.insecure_channel(address) as channel:  # it answers Status, saying what it waits for
        reply = rpc.SyncerStub(channel).Status(pb.StatusRequest(), metadata=auth_metadata(sh.TOKEN), timeout=10)
    assert reply.unseeded and list(reply.versions) == [0, 0]


def _seed(address: str, chunks: list[pb.SeedChunk]) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        rpc.SyncerStub(channel).Seed(iter(chunks), metadata=auth_metadata(sh.TOKEN), timeout=10)
    return info.value


def test_bad_seeds_are_refused_and_leave_the_syncer_unseeded(unseeded) -> None:
    address, gate, _ = unseeded
    good = sh.params(0)

    def chunks(tensors: dict[str, np.ndarray], shapes: dict | None = None, **header: object) -> list[pb.SeedChunk]:
        out = list(seed_chunks("a-0", dict(sh.SHAPES) if shapes is None else shapes, tensors))
        for k, v in header.items():
            setattr(out[0].header, k, v)
        return out

    nan = dict(good, **{"head/kernel": np.full(sh.SHAPES["head/kernel"], np.nan, np.float32)})
    cases = {
        "non-finite": (chunks(nan), "non-finite"),
        "hash": (chunks(good, init_hash=b"\0" * 32), "init_hash does not match"),
        "missing tensor": (chunks({k: v for k, v in good.items() if k != "head/kernel"}), "does not hold this shard's"),
        "no shapes": (chunks(good, shapes={}), "0 tensors"),
        "zero size": (chunks(good, shapes=dict(sh.SHAPES, extra=(0, 3))), "positive sizes"),
        "truncated": (chunks(good)[:1] + [pb.SeedChunk(data=b"")], None),
        "oversized": (chunks(good, total_bytes=1 << 50), "more than one syncer holds"),
        "learner id": (chunks(good, learner=""), "learner id"),
    }
    cases["truncated"][0][0].header.total_bytes += 7
    for name, (msgs, why) in cases.items():
        err = _seed(address, msgs)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.details())
        if why:
            assert why in err.details(), (name, err.details())
    assert not gate.seeded.is_set() and gate.model is None
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        rpc.SyncerStub(channel).Seed(iter(chunks(good)), metadata=auth_metadata("wrong-token-000000000"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and not gate.seeded.is_set()


def test_a_shard_is_seeded_with_its_own_fragments_only() -> None:
    spec = SyncerSpec(fragments=2, shards=2)  # a plan of 4
    init = initial(0, spec)
    msgs = list(seed_chunks("a-0", dict(sh.SHAPES), init.held_by(1, 2)))
    model = seeded_model(spec, 1, msgs[0].header, b"".join(c.data for c in msgs))
    assert model.held() == set(init.held_by(1, 2)) and model.owned == (1, 3)
    assert model.init_hash == init.hash_for(1, 2) != init.hash_for(0, 2)
    assert parse_unseeded(unseeded_message(1, 2)) == (1, 2) and parse_unseeded("something else") is None


def test_a_seed_is_built_in_twice_the_shards_own_bytes() -> None:
    """Received into one buffer of the size the header implies, decoded once, the other shards'
    tensors never materialised: a syncer keeps freed memory, so the peak stays its size (a 4 GB
    model took 15.4 GB on one shard and 9.7 GB on each of two before)."""
    shapes = {f"layers_{i}/kernel": (256, 512) for i in range(8)}  # 0.5 MiB each, 4 MiB in all
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    spec = SyncerSpec(fragments=2, shards=2)  # a plan of 4
    plan = plan_fragments(specs_from_shapes(shapes), spec.plan_size, spec.fragmentation)
    held = InitialModel(tensors, plan.fragments).held_by(0, 2)
    first, *rest = seed_chunks("a-0", shapes, held)
    own = sum(v.nbytes for v in held.values())
    assert own == 2 << 20 and first.header.total_bytes == bundle_size({n: v.shape for n, v in held.items()}, "fp32")
    seeded_model(spec, 0, first.header, receive_seed(first, iter(rest), first.header.total_bytes))  # imports done
    tracemalloc.start()
    try:
        model = seeded_model(spec, 0, first.header, receive_seed(first, iter(rest), first.header.total_bytes))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert model.held() == set(held) and all(np.array_equal(model.params[n], v) for n, v in held.items())
    assert all(model.params[n].strides == (0, 0) for n in set(shapes) - set(held))
    assert own * 2 <= peak < own * 2.2, peak / own
    with pytest.raises(Refused, match="larger than the"):
        receive_seed(first, iter(rest), first.header.total_bytes - 1)
    with pytest.raises(Refused, match=r"\d+ of \d+ bytes"):
        receive_seed(first, iter(rest[:-1]), first.header.total_bytes)


@pytest.mark.slow
def test_a_syncer_process_without_jax_is_seeded_and_serves(tmp_path: Path) -> None:
    job = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "nojax"},
           "spec": {"learnerGroups": [{"name": "a", "replicas": 2}], "syncer": {"fragments": 2}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = subprocess.Popen([sys.executable, "-P", "-c", without_learner_extra(), "syncer", "--config", str(tmp_path / "job.yaml"),
                             "--port", "0", "--checkpoint-dir", str(tmp_path / "ckpt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, DILOCO_TOKEN=sh.TOKEN))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("SYNCER_READY"), (line, proc.stderr.read() if proc.poll() is not None else "")
        address = "127.0.0.1:" + line.split("port=")[1].split()[0]
        client = SyncerClient(address, sh.TOKEN, "a-0", "r")
        state = client.join_with_retry(dict(sh.SHAPES), initial(0))  # the model is the learner's, not the syncer's
        assert set(state.params) == set(sh.SHAPES) and state.versions == [0, 0]
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0
    assert CheckpointStore(tmp_path / "ckpt").load_latest()[0] is not None  # the seeded Θ₀ is durable
    log = proc.stderr.read() if proc.stderr else ""
    # Its head-room reserved once seeded, and protobuf's pure-Python backend, whose upb would
    # hand that back to the kernel with malloc_trim (apps/commands.py cmd_syncer).
    assert "MB of heap for republished fragments" in log and "protobuf: python" in log, log[-2000:]
