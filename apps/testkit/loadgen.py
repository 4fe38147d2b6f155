"""Synthetic learners: real gRPC clients of a real syncer, without JAX or a model.

Each one joins (keeping only the Join header: the model itself is not needed), subscribes as
a learner does, and pushes a precomputed int4 outer gradient of the due fragment at every slot
of the shared schedule (slot s is fragment s mod P, due at t0 + s·T). It records when each
slot's merge reached it. Against a sharded syncer of N shards (`--address` lists every shard's,
in order) it joins and subscribes to every shard and, in each slot, pushes the slot's N
fragments, one to each shard, side by side, as learners do (core/schedule.py); a slot's merge has
reached it when every shard's part has. `bench/syncer_scale.py` runs this in its own process against a syncer
process to measure how many learners one syncer really sustains.

    python -m diloco.apps.testkit.loadgen --address 127.0.0.1:PORT --shapes shapes.json \\
        --learners 8 --step-seconds 1 --slots 48      # the job token in $DILOCO_TOKEN

Last line: JSON (see `Report`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from diloco.contract import TOKEN_ENV
from diloco.core.codecs import encode_tensors
from diloco.core.fragments import Method, owner, plan_fragments, specs_from_shapes
from diloco.core.schedule import due_fragments
from diloco.core.seed import InitialModel
from diloco.shards import syncer_addresses
from diloco.wire import GRPC_OPTIONS, auth_metadata, pb, push, rpc, seed_chunks


@dataclass
class Report:
    learners: int
    slots: int  # slots measured (after the first P, which start the rounds up)
    in_time: int  # of those: merged and received by every learner before the next slot began
    refused: int  # pushes the syncer did not accept
    late_pushes: int  # pushes sent after their slot had ended (the learners' side fell behind)
    worst_merge_seconds: float  # latest arrival of a slot's merge, from the slot's start
    bytes_pushed: int
    bytes_received: int
    missed: dict[int, float] = field(default_factory=dict)  # slot (from the first pushed) -> when its merge arrived
    joins: list[float] = field(default_factory=list)  # seconds of each whole Join made meanwhile (--rejoin-every)

    @property
    def sustained(self) -> bool:
        """Every push accepted and sent on time, and every slot merged within the slot."""
        return self.refused == 0 and self.late_pushes == 0 and self.in_time == self.slots


@dataclass
class _Link:
    """One synthetic learner's connection to one syncer shard."""

    channel: grpc.Channel
    stub: rpc.SyncerStub
    header: pb.JoinHeader


@dataclass
class _Learner:
    name: str
    links: list[_Link]  # one per syncer shard, in shard order
    versions: list[int]
    arrivals: dict[tuple[int, int], float] = field(default_factory=dict)  # (closed slot, shard) -> when its merge arrived
    refused: int = 0
    late: int = 0
    bytes_pushed: int = 0
    bytes_received: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def outer_gradients(shapes: Mapping[str, tuple[int, ...]], fragments: list[list[str]], seed: int = 0) -> list[bytes]:
    """One int4 payload per fragment, encoded once: pushing costs the syncer what a real push does."""
    rng = np.random.default_rng(seed)
    return [bytes(encode_tensors({n: (1e-3 * rng.standard_normal(shapes[n])).astype(np.float32) for n in names}, "int4"))
            for names in fragments]


def seed(addresses: list[str], token: str, shapes: Mapping[str, tuple[int, ...]], fragments: int,
         method: Method = "balanced") -> None:
    """Seed fresh syncer shards with a synthetic Θ₀ (zeros; a syncer runs no model code, so
    learners bring it: syncer/joins/seeding.py). The plan is what the syncer will derive: P
    (`fragments`) per shard."""
    plan = plan_fragments(specs_from_shapes(shapes), fragments * len(addresses), method)
    initial = InitialModel({n: np.zeros(s, np.float32) for n, s in shapes.items()}, plan.fragments)
    for i, address in enumerate(addresses):
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            stream = seed_chunks("loadgen", shapes, initial.held_by(i, len(addresses)))
            rpc.SyncerStub(channel).Seed(stream, metadata=auth_metadata(token), timeout=600)


def join(addresses: list[str], token: str, name: str, shapes: Mapping[str, tuple[int, ...]]) -> _Learner:
    links = []
    request = pb.JoinRequest(learner=name, region="bench", process=os.getpid(), supersede=True,
                             tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in sorted(shapes.items())])
    for address in addresses:
        channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        stub = rpc.SyncerStub(channel)
        stream = stub.Join(request, metadata=auth_metadata(token), timeout=600)
        header = next(iter(stream)).header  # the model follows; a synthetic learner does not need it
        stream.cancel()
        links.append(_Link(channel, stub, header))
    n = len(links)
    versions = [links[owner(p, n)].header.versions[p] for p in range(len(links[0].header.fragments))]
    return _Learner(name, links, versions)


def full_join(addresses: list[str], token: str, name: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[float, int]:
    """One whole Join of every shard, read to its last byte as a re-admitted learner reads it:
    (seconds, bytes received). The messages are not parsed: on a 2-core machine this process
    shares a core with the synthetic learners, and their pushes must not wait for it."""
    request = pb.JoinRequest(learner=name, region="bench", process=os.getpid(), supersede=True,
                             tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in sorted(shapes.items())])
    t0, got = time.monotonic(), 0
    for address in addresses:
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            join_raw = channel.unary_stream("/diloco.v1.Syncer/Join", request_serializer=pb.JoinRequest.SerializeToString,
                                            response_deserializer=None)  # raw bytes: the model is not needed
            for raw in join_raw(request, metadata=auth_metadata(token), timeout=600):
                got += len(raw)
    return time.monotonic() - t0, got


def rejoins(addresses: list[str], token: str, shapes: Mapping[str, tuple[int, ...]], start: float, every: float,
            count: int, name: str) -> list[float]:
    """`count` whole Joins, one every `every` seconds from `start` (time.monotonic, which is the
    same clock in every process here): the syncer's side of learners being re-admitted while the
    others train. A Join alone does not make a learner active (its subscription does), so the
    rounds do not wait for this one. Returns each Join's seconds."""
    took = []
    for k in range(count):
        time.sleep(max(0.0, start + k * every - time.monotonic()))
        took.append(round(full_join(addresses, token, name, shapes)[0], 2))
    return took


def _start_rejoins(address: str, shapes_file: str, start: float, every: float, count: int,
                   prefix: str) -> subprocess.Popen[str]:
    """`rejoins` in a process of its own (receiving a whole model through Python gRPC takes
    seconds of CPU, which would otherwise delay this process's pushes)."""
    return subprocess.Popen([sys.executable, "-P", "-m", "diloco.apps.testkit.loadgen", "--address", address, "--shapes", shapes_file,
                             "--rejoins", str(count), "--rejoin-every", str(every), "--rejoin-start", repr(start),
                             "--prefix", prefix], stdout=subprocess.PIPE, text=True)


def _subscribe(lr: _Learner, shard: int, link: _Link, token: str, stop: threading.Event) -> None:
    request = pb.SubscribeRequest(learner=lr.name, incarnation=link.header.incarnation, known_versions=lr.versions,
                                  exact=True, session_secret=link.header.session_secret)
    stream = link.stub.Subscribe(request, metadata=auth_metadata(token))
    stopper = threading.Thread(target=lambda: (stop.wait(), stream.cancel()), daemon=True)
    stopper.start()
    received = 0
    try:
        for msg in stream:
            received += len(msg.data)
            if msg.last:
                lr.versions[msg.fragment] = msg.version
                lr.arrivals.setdefault((msg.slot - 1, shard), time.monotonic())  # Published.slot: the closed slot + 1
    except grpc.RpcError:
        if not stop.is_set():
            raise
    finally:
        with lr.lock:  # the learner's other shards' streams add theirs
            lr.bytes_received += received


def _push_loop(lr: _Learner, shard: int, token: str, payloads: Sequence[bytes | memoryview], first_slot: int, slots: int, t0: float,
               step_seconds: float, ids: itertools.count) -> None:
    """One learner's pushes to one shard: the slot's fragment that shard owns, every slot."""
    link, shards = lr.links[shard], len(lr.links)
    pushed = refused = late = 0  # added to the learner's at the end: its other shards' threads add theirs
    for s in range(first_slot, first_slot + slots):
        due = t0 + (s - first_slot) * step_seconds
        time.sleep(max(0.0, due - time.monotonic()))
        p = due_fragments(s, len(payloads), shards)[shard]  # fragment q belongs to shard q mod N
        blob = payloads[p]
        header = pb.PushHeader(
            learner=lr.name, region="bench", incarnation=link.header.incarnation, fragment=p,
            base_version=lr.versions[p], steps=1, tokens=1024, step_seconds=step_seconds, total_bytes=len(blob),
            push_id=next(ids), slot=s, session_tokens=1024 * (s - first_slot + 1), session=os.getpid(),
            session_secret=link.header.session_secret)
        try:
            accepted = push(link.stub, header, blob, auth_metadata(token), timeout=60).accepted  # as a learner's client pushes
        except grpc.RpcError:  # counted, not fatal: the thread keeps the schedule and the counts stay true
            accepted = False
        pushed += len(blob)
        refused += not accepted
        late += time.monotonic() > due + step_seconds
    with lr.lock:
        lr.bytes_pushed, lr.refused, lr.late = lr.bytes_pushed + pushed, lr.refused + refused, lr.late + late


def _join_team(addresses: list[str], token: str, shapes: Mapping[str, tuple[int, ...]], learners: int, prefix: str,
               stop: threading.Event) -> tuple[list[_Learner], list[threading.Thread], int]:
    """Join `learners` synthetic learners and subscribe each to every shard in a thread, as the
    learner's client does: (the team, its readers, the newest slot any shard said)."""
    team = [join(addresses, token, f"{prefix}-{i}", shapes) for i in range(learners)]
    readers = [threading.Thread(target=_subscribe, args=(lr, shard, link, token, stop), daemon=True)
               for lr in team for shard, link in enumerate(lr.links)]
    for t in readers:
        t.start()
    return team, readers, max(int(link.header.slot) for lr in team for link in lr.links)


def _train(team: list[_Learner], token: str, payloads: Sequence[bytes | memoryview], first_slot: int, slots: int, t0: float,
           step_seconds: float, readers: list[threading.Thread], stop: threading.Event) -> None:
    """Push for `slots` slots from `t0` (each learner to each shard side by side), let the last
    merges arrive, and hang up."""
    pushers = [threading.Thread(target=_push_loop, args=(lr, shard, token, payloads, first_slot, slots, t0, step_seconds,
                                                         ids))
               for lr in team for ids in [itertools.count(1)] for shard in range(len(lr.links))]
    for t in pushers:
        t.start()
    for t in pushers:
        t.join()
    time.sleep(2 * step_seconds)  # the last slots' merges arrive
    stop.set()
    for t in readers:
        t.join(timeout=10)
    for lr in team:
        for link in lr.links:
            link.channel.close()


@dataclass
class _Outcome:
    """What one process's synthetic learners saw: what the report is made of."""

    arrivals: list[list[tuple[int, int, float]]]  # per learner: (closed slot, shard, when its merge arrived)
    refused: int
    late: int
    bytes_pushed: int
    bytes_received: int

    @classmethod
    def of(cls, team: list[_Learner]) -> _Outcome:
        return cls([[(c, i, t) for (c, i), t in lr.arrivals.items()] for lr in team], sum(lr.refused for lr in team),
                   sum(lr.late for lr in team), sum(lr.bytes_pushed for lr in team), sum(lr.bytes_received for lr in team))


def run(address: str, token: str, shapes: Mapping[str, tuple[int, ...]], learners: int, step_seconds: float,
        slots: int, prefix: str = "synthetic", warmup_cycles: int = 1, rejoin_every: float = 0.0,
        shapes_file: str = "", processes: int = 1) -> Report:
    """Join `learners` synthetic learners, push for `slots` slots, and report. `address`: one
    host:port, or every shard's of a sharded syncer, comma-separated in shard order. With
    `rejoin_every`, another process makes a whole Join that often while the slots are counted.
    With `processes` > 1 the learners are spread over that many processes (`shapes_file` needed),
    started on one clock: learners are processes of their own, and one Python process's gRPC
    threads share its interpreter lock, which then limits the load generator, not the syncer."""
    addresses = syncer_addresses(address)
    shards = len(addresses)
    stop = threading.Event()
    if processes <= 1:
        team, readers, latest = _join_team(addresses, token, shapes, learners, prefix, stop)
        header = team[0].links[0].header
    else:  # the plan, from a Join's header (a Join alone does not make a learner active)
        probe = join(addresses, token, f"{prefix}-probe", shapes)
        header = probe.links[0].header
        for link in probe.links:
            link.channel.close()
    payloads = outer_gradients(shapes, [list(f.names) for f in header.fragments])  # before the clock starts
    if processes > 1:
        tmp = tempfile.TemporaryDirectory(prefix="loadgen-")
        shared = Path(tmp.name) / "payloads"  # written once, mapped by every process
        shared.write_bytes(b"".join(payloads))
        sizes = ",".join(str(len(b)) for b in payloads)
        workers = _start_workers(address, shapes_file, f"{shared}:{sizes}", learners, processes, step_seconds, slots,
                                 prefix)
        ready = [json.loads(w.stdout.readline() or "null") for w in workers]  # type: ignore[union-attr]
        if None in ready:
            raise SystemExit("a load generator process exited before its learners joined; see its stderr above")
        latest = max(r["slot"] for r in ready)
    num = len(header.fragments) // shards  # P: the slots of a cycle
    first_slot = (latest // num + 1) * num  # a fresh cycle
    t0 = time.monotonic() + 1.0  # subscriptions settle first (CLOCK_MONOTONIC: one clock for every process here)
    joiner = None
    if rejoin_every > 0:  # started now, so its own start-up is not in the counted slots
        counted = t0 + warmup_cycles * num * step_seconds
        count = max(1, int((slots - warmup_cycles * num) * step_seconds // rejoin_every))
        joiner = _start_rejoins(address, shapes_file, counted, rejoin_every, count, f"{prefix}-rejoin")
    if processes <= 1:
        _train(team, token, payloads, first_slot, slots, t0, step_seconds, readers, stop)
        outcomes = [_Outcome.of(team)]
    else:
        for w in workers:  # every one told before any is waited for
            w.stdin.write(f"{t0!r} {first_slot}\n")  # type: ignore[union-attr]
            w.stdin.flush()  # type: ignore[union-attr]
        outcomes = [_Outcome(**json.loads(w.communicate(timeout=600 + 4 * slots * step_seconds)[0].strip().splitlines()[-1]))
                    for w in workers]
        tmp.cleanup()
    joins = json.loads(joiner.communicate(timeout=600)[0].strip().splitlines()[-1]) if joiner else []
    # Not counted: the first cycle, which opens every fragment's rounds, and any further warm-up
    # cycles (a large model's first publishes grow the syncer's heap; their backlog spills over).
    measured = range(first_slot + warmup_cycles * num, first_slot + slots)
    arrivals = [a for o in outcomes for a in o.arrivals]
    worst, in_time, missed = 0.0, 0, {}
    for s in measured:
        start = t0 + (s - first_slot) * step_seconds
        arrived = [max(min((t for c, i, t in got if i == shard and c >= s and c % num == s % num), default=float("inf"))
                       for shard in range(shards))
                   for got in arrivals]
        latest_s = max(arrived) - start  # the slot's merge has reached every learner
        worst = max(worst, latest_s)
        in_time += latest_s <= step_seconds
        if latest_s > step_seconds:
            missed[s - first_slot] = round(latest_s, 2)
    return Report(learners, len(measured), in_time, sum(o.refused for o in outcomes), sum(o.late for o in outcomes),
                  round(worst, 3), sum(o.bytes_pushed for o in outcomes), sum(o.bytes_received for o in outcomes), missed,
                  joins)


def _start_workers(address: str, shapes_file: str, payloads: str, learners: int, processes: int, step_seconds: float,
                   slots: int, prefix: str) -> list[subprocess.Popen[str]]:
    """`processes` load generators of their share of the learners each, joined and subscribed
    when they print their ready line; each starts pushing when told the common start."""
    if not shapes_file:
        raise ValueError("processes > 1 needs the shapes file")
    shares = [learners // processes + (k < learners % processes) for k in range(processes)]
    return [subprocess.Popen([sys.executable, "-P", "-m", "diloco.apps.testkit.loadgen", "--address", address, "--shapes", shapes_file,
                              "--learners", str(m), "--step-seconds", str(step_seconds), "--slots", str(slots),
                              "--prefix", f"{prefix}-p{k}", "--worker", payloads], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for k, m in enumerate(shares) if m > 0]


def _work(address: str, token: str, shapes: Mapping[str, tuple[int, ...]], learners: int, step_seconds: float, slots: int,
          prefix: str, shared: str) -> None:
    """One of `run`'s processes: join and subscribe, say so, push from the start the parent
    sends on stdin, and print what the learners saw. `shared`: FILE:SIZE,SIZE,... the payloads
    the parent wrote, one per fragment, mapped rather than made again."""
    path, sizes = shared.rsplit(":", 1)
    with open(path, "rb") as fh:
        mapped = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
    ends = list(itertools.accumulate(int(n) for n in sizes.split(",")))
    payloads = [mapped[end - int(n):end] for end, n in zip(ends, sizes.split(","))]
    stop = threading.Event()
    team, readers, latest = _join_team(syncer_addresses(address), token, shapes, learners, prefix, stop)
    print(json.dumps({"slot": latest}), flush=True)
    t0, first_slot = sys.stdin.readline().split()
    _train(team, token, payloads, int(first_slot), slots, float(t0), step_seconds, readers, stop)
    print(json.dumps(asdict(_Outcome.of(team))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True)
    parser.add_argument("--shapes", required=True, help="JSON file: tensor name -> shape, as the syncer's model")
    parser.add_argument("--learners", type=int)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--slots", type=int, default=48, help="slots to push (the first P start the rounds)")
    parser.add_argument("--warmup-cycles", type=int, default=1, help="cycles of P slots pushed but not counted")
    parser.add_argument("--prefix", default="synthetic", help="learner ids: PREFIX-0, PREFIX-1, ...")
    parser.add_argument("--rejoin-every", type=float, default=0.0,
                        help="seconds between whole Joins another process makes while the slots are counted (0: none)")
    parser.add_argument("--processes", type=int, default=1,
                        help="processes the learners are spread over (one Python process's gRPC threads share one lock)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one of --processes: FILE:SIZES of the payloads
    parser.add_argument("--rejoins", type=int, default=0, help=argparse.SUPPRESS)  # the joining process's own
    parser.add_argument("--rejoin-start", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with open(args.shapes) as fh:
        shapes = {k: tuple(v) for k, v in json.load(fh).items()}
    if args.rejoins:
        os.nice(19)  # it stands in for a learner on another machine: it takes what the learners leave of this core
        print(json.dumps(rejoins(syncer_addresses(args.address), os.environ[TOKEN_ENV], shapes, args.rejoin_start,
                                 args.rejoin_every, args.rejoins, args.prefix)), flush=True)
        return
    if args.learners is None:
        parser.error("--learners is required")
    if args.worker:
        _work(args.address, os.environ[TOKEN_ENV], shapes, args.learners, args.step_seconds, args.slots, args.prefix,
              args.worker)
        return
    report = run(args.address, os.environ[TOKEN_ENV], shapes, args.learners, args.step_seconds, args.slots, args.prefix,
                 args.warmup_cycles, args.rejoin_every, args.shapes, args.processes)
    print(json.dumps({**asdict(report), "sustained": report.sustained}), flush=True)


if __name__ == "__main__":
    main()
