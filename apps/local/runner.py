"""`diloco run FILE`: the same manifest a cluster takes, as processes on this machine.

One syncer process per shard, one process per learner replica and host (each pinned to a core),
chaos as the manifest says (SIGKILL a learner, restart it after the delay as a StatefulSet would),
a live view, and in --out: events.jsonl, summary.json and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from diloco.apps.local.procs import Child, Supervisor, free_port
from diloco.apps.local.tracker import RunTracker
from diloco.contract import (
    CACHE_EVERY_PROGRAM,
    TOKEN_ENV,
    Exit,
    LearnerArgs,
    SyncerArgs,
    diloco_argv,
    permanent_failure,
)
from diloco.core.chaos import SYNCER, ChaosSchedule, Kill
from diloco.launch import load_config
from diloco.shards import aggregate, checkpoint_dir, syncer_name
from diloco.spec import DecoupledDiLoCoJob, JobSpec, dump_job
from diloco.wire import GRPC_OPTIONS, auth_metadata, pb, rpc

POLL_SECONDS = 1.0  # status poll: often enough for the progress view, cheap for the syncer


class LocalRun:
    def __init__(self, job: DecoupledDiLoCoJob, out: Path, max_seconds: float | None):
        self.job, self.out = job, out
        spec = job.spec
        limits = [s for s in (max_seconds, spec.training.duration_seconds, spec.run_policy.active_deadline_seconds) if s]
        self.max_seconds = min(limits) if limits else None
        out.mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        self.config = out / "job.yaml"
        self.config.write_text(yaml.safe_dump(dump_job(job), sort_keys=False))
        self.token = secrets.token_hex(16)
        shards = spec.syncer.shards
        self.ports = [free_port() for _ in range(shards)]
        env = dict(os.environ, **{
            TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1",
            # A restarted learner reuses the compiled step: re-admission in ~1 s instead of ~5 s.
            "JAX_COMPILATION_CACHE_DIR": str(out / "jax-cache"), **CACHE_EVERY_PROGRAM,
        })
        self.sup = Supervisor(env, zygote_log=out / "logs" / "zygote.log")
        self.syncers = [syncer_name(s, shards) for s in range(shards)]
        for s, (name, port) in enumerate(zip(self.syncers, self.ports)):
            syncer = SyncerArgs(str(self.config), port=port, metrics_port=free_port(),
                                checkpoint_dir=checkpoint_dir(str(out / "checkpoints"), s, shards), shard=s if shards > 1 else None)
            self.sup.add(Child(name, "syncer", diloco_argv("syncer", syncer.argv()), out / "logs" / f"{name}.log"))
        addresses = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        groups = {g.name: g for g in spec.learner_groups}
        learners = spec.learner_ids()
        plan = core_plan(sorted(os.sched_getaffinity(0)), [groups[x.group].hosts_per_learner for x in learners], shards)
        for learner, cores in zip(learners, plan):
            h = len(cores)
            (device, host), *_ = cores
            args = LearnerArgs(str(self.config), learner.group, learner.index, addresses,
                               metrics_port=free_port() if h == 1 else None,
                               cpus=device if h == 1 else None, host_cpus=host if h == 1 else None)
            hosts = [] if h == 1 else [["--process-id", str(k), "--num-processes", str(h), "--cpus", d,
                                        *(["--host-cpus", c] if c else []), "--metrics-port", str(free_port())]
                                       for k, (d, c) in enumerate(cores)]
            self.sup.add(Child(str(learner), "learner", diloco_argv("learner", args.argv()),
                               out / "logs" / f"{learner}.log", hosts=hosts, env=cpu_devices(spec, h)))
        self.tracker = RunTracker([n for n, c in self.sup.children.items() if c.kind == "learner"])
        self.events = open(out / "events.jsonl", "w", encoding="utf-8")  # noqa: SIM115
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) for port in self.ports]
        self.stubs = [rpc.SyncerStub(c) for c in self.channels]
        self.stopping = False
        self.failure: str | None = None
        self.failure_code = Exit.FAILED  # the exit code of `diloco run` that failed: a learner's permanent one
        self.fatal: dict[str, str] = {}  # a child's last fatal event's reason: the line it ended on
        self.finished: set[str] = set()  # learners that reached spec.training.steps and exited 0
        self.chaos, self.kills_made = ChaosSchedule(spec.chaos), 0

    def record(self, event: dict[str, Any]) -> None:
        self.events.write(json.dumps(event) + "\n")
        self.tracker.observe(event)
        if event.get("event") == "fatal" and isinstance(event.get("reason"), str):
            self.fatal[str(event.get("source"))] = event["reason"]

    def runner_event(self, event: str, **fields: Any) -> None:
        self.record({"t": time.time(), "event": event, "source": "runner", **fields})

    def poll_status(self) -> None:
        replies: list[pb.StatusReply | None] = []
        for stub in self.stubs:
            try:
                replies.append(stub.Status(pb.StatusRequest(), metadata=auth_metadata(self.token), timeout=2.0))
            except grpc.RpcError:
                replies.append(None)
        if len(replies) > 1:  # each shard on its own: one restarting must not hide the others
            self.runner_event("shard_status", shards=[None if r is None else {
                "incarnation": r.incarnation, "outer_steps": r.outer_steps, "checkpoint_version": r.checkpoint_version,
                "seconds_since_publish": r.seconds_since_publish, "versions": list(r.versions)} for r in replies])
        answered = [r for r in replies if r is not None]
        if len(answered) < len(replies):  # the job's syncer is up when every shard answers
            return
        reply = aggregate(answered)
        self.runner_event("status", versions=list(reply.versions), outer_steps=reply.outer_steps,
                          tokens_merged=reply.tokens_merged, active_learners=reply.active_learners,
                          seconds_since_publish=reply.seconds_since_publish, incarnation=reply.incarnation,
                          bytes_received=reply.bytes_received, bytes_sent=reply.bytes_sent,
                          refused=reply.contributions_refused, checkpoint_version=reply.checkpoint_version,
                          max_norm_ratio=reply.max_norm_ratio, max_steps_ratio=reply.max_steps_ratio,
                          refused_by=dict(reply.refused_by_outcome),
                          learners_trained={ls.learner: ls.tokens_trained for ls in reply.learners})

    def run(self, view: Any) -> dict[str, Any]:
        spec = self.job.spec
        t0 = time.time()
        self.runner_event("start", job=self.job.metadata.name, learners=spec.total_learners, port=self.ports[0],
                          ports=self.ports)
        for name in self.syncers:
            self.sup.start(name)
        for name, c in self.sup.children.items():
            if c.kind == "learner":
                self.sup.start(name)
                self.runner_event("spawned", target=name, restarts=0, pids=[p.pid for p in c.procs])
        next_poll = t0
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        try:
            while not self.stopping:
                now = time.time()
                self._drain()
                self._restart_due(now)
                self.failure = self._detect_crashes(now)
                if self.failure:
                    self.runner_event("failed", reason=self.failure)
                    break
                if self.finished and self.finished >= set(self.tracker.slots):
                    self.runner_event("finished", steps=spec.training.steps)
                    break
                self.chaos_step(now - t0)
                if now >= next_poll:
                    self.poll_status()
                    next_poll = now + POLL_SECONDS
                view.update(self.tracker, now - t0, self.max_seconds)
                if self.max_seconds and now - t0 >= self.max_seconds:
                    break
                budget = spec.training.token_budget
                if budget and self.tracker.tokens_merged >= budget:
                    self.runner_event("budget_reached", tokens_merged=self.tracker.tokens_merged)
                    break
                time.sleep(0.1)
        except KeyboardInterrupt:
            self.runner_event("interrupted")
        return self.finish(t0)

    def chaos_step(self, elapsed: float) -> list[Kill]:
        """Make the kills the schedule has due `elapsed` seconds into the run. Up means joined
        and training (a learner) or answering Status (the syncer), as the tracker saw it."""
        expected = self.chaos.targets(n for n in self.tracker.slots if n not in self.finished)
        up = {n for n, s in self.tracker.slots.items() if s.up}
        if self.tracker.syncer_up_since is not None:
            up.add(SYNCER)
        kills = self.chaos.plan(elapsed, self.kills_made, expected, up)
        for kill in kills:  # a sharded syncer loses one shard at a time, in turn
            process = self.syncers[kill.number % len(self.syncers)] if kill.target == SYNCER else kill.target
            self.sup.kill(process)
            self.runner_event("kill", target=kill.target, process=process, signal="SIGKILL", number=kill.number)
            self.kills_made += 1
        return kills

    def _drain(self) -> None:
        while not self.sup.events.empty():
            self.record(self.sup.events.get_nowait())

    def _restart_due(self, now: float) -> None:
        delay = self.job.spec.chaos.restart_delay_seconds
        for name, c in self.sup.children.items():
            if c.down_since is not None and now - c.down_since >= delay:
                c.restarts += 1
                self.sup.start(name, ["--restart", str(c.restarts)] if c.kind == "learner" else None)
                self.runner_event("restart", target=name, restarts=c.restarts)
                self.runner_event("spawned", target=name, restarts=c.restarts, pids=[p.pid for p in c.procs])

    def _detect_crashes(self, now: float) -> str | None:
        """A child that exits on its own is restarted like a killed one, up to backoffLimit;
        a configuration or authentication failure (a permanent exit code) ends the run at once; a
        learner that exits 0 has reached spec.training.steps and is done."""
        for name, c in self.sup.children.items():
            if name in self.finished:
                continue
            code = c.exit_code() if c.down_since is None else None
            if code is not None:
                if len(c.procs) > 1:  # a learner cannot lose a host: the whole gang restarts
                    self.sup.kill(name)
                self.runner_event("exited", target=name, returncode=code)
                if code == Exit.OK and c.kind == "learner":
                    self.finished.add(name)
                    continue
                if c.restarts >= self.job.spec.run_policy.backoff_limit or permanent_failure(code):
                    self.failure_code = Exit(code) if permanent_failure(code) else Exit.FAILED
                    return self._why(name, code)
                c.down_since = now
        return None

    def _why(self, name: str, code: int) -> str:
        """A child that ended the run: the line it ended on (its fatal event's reason, else its log's
        last line: a learner refused its data at start-up on stderr), and where its log is."""
        c = self.sup.children[name]
        if c.reader is not None:  # its last events, the fatal one among them, may still be in the pipe
            c.reader.join(timeout=2.0)
        self._drain()
        reason = self.fatal.get(name) or last_line(c.log_path)
        return f"{name} exited with code {code}: {reason} (log: {c.log_path})" if reason else \
            f"{name} exited with code {code}; see {c.log_path}"

    def finish(self, t0: float) -> dict[str, Any]:
        self.sup.stop_all(("learner",))
        self.sup.close()
        self._drain()
        self.poll_status()
        self.sup.stop_all(("syncer",))
        self._drain()
        wall = time.time() - t0
        self.runner_event("stop", wall_seconds=wall)
        self.events.close()
        for channel in self.channels:
            channel.close()
        from diloco.apps.local.report import write_report

        return write_report(self.job, self.out, self.tracker, wall, self.failure)


def last_line(path: Path, tail: int = 8192) -> str | None:
    """The last non-empty line of a log (its last `tail` bytes read), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = [line.strip() for line in f.read().decode("utf-8", errors="replace").splitlines()]
    except OSError:
        return None
    return next((line for line in reversed(lines) if line), None)


def core_plan(cpus: list[int], hosts: list[int], syncers: int) -> list[list[tuple[str, str | None]]]:
    """Per learner, per host process: the core its XLA device runs on (`--cpus`) and the core
    its own threads run on (`--host-cpus`, or None for the same core).

    Every learner process gets a core of its own while there are cores enough, else they
    take the cores in turn (learners share them fairly when pinned). A host core comes only
    when every process can have one and a core is still left for each syncer shard: then each
    learner runs as on an accelerator, its gRPC client and loop beside its device instead of on
    it (`bench/learner.py`, `host_core`: 0.99-1.01 of the plain loop against 0.96-0.97)."""
    processes = sum(hosts)
    split = len(cpus) >= 2 * processes + syncers
    plan, process = [], 0
    for h in hosts:
        plan.append([(str(cpus[(process + k) % len(cpus)]), str(cpus[processes + process + k]) if split else None)
                     for k in range(h)])
        process += h
    return plan


def cpu_devices(spec: JobSpec, hosts: int) -> dict[str, str]:
    """Locally, a learner process gets its share of the mesh as CPU devices (XLA's host
    platform): data x fsdp / hostsPerLearner when the mesh names both sizes, else one."""
    mesh = spec.training.mesh
    if -1 in (mesh.data, mesh.fsdp) or mesh.data * mesh.fsdp <= 1:
        return {}
    per_host = max(1, mesh.data * mesh.fsdp // hosts)
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={per_host}") if f)
    return {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def main(args: argparse.Namespace) -> int:
    from diloco.apps.local.view import make_view
    from diloco.inputs import reads_data
    from diloco.trainer.data import probe

    job = load_config(args.file, inputs=True)  # every input there, or exit 2 before any process
    refused = probe.problems(job) if reads_data(job) else []  # the data read as the learners will read it
    if refused:
        for line in refused:
            print(line, file=sys.stderr)
        return Exit.CONFIG
    out = Path(args.out or Path("runs") / job.metadata.name)
    run = LocalRun(job, out, args.max_seconds)
    with make_view(live=not args.no_live, job=job) as view:
        summary = run.run(view)
    view.final(summary, out)
    if summary.get("failure"):  # the line the run ended on, where a person looks for it
        print(f"diloco run: {summary['failure']}", file=sys.stderr)
        return int(run.failure_code)
    return 0
