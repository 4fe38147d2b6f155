"""Subcommand registration. Handlers import their component lazily so `diloco --help` and
`diloco validate` start fast and never load JAX or gRPC (validate runs the operator's pure
admission checks, which the syncer image has)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from diloco import contract, extras

if TYPE_CHECKING:
    from diloco.spec import DecoupledDiLoCoJob, JobSpec


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Every subcommand: running a job and its processes, then the tools on a model and a cluster."""
    _add_job_parsers(sub)
    _add_model_parsers(sub)
    _add_cluster_parsers(sub)


def _add_job_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a DecoupledDiLoCoJob manifest as the operator does at admission")
    p.add_argument("file", help="YAML manifest")
    p.add_argument("--gateway-api", action="store_true",
                   help="the operator was installed with syncerExposure.gatewayAPI=true (GRPCRoute exposure allowed)")
    p.add_argument("--inputs", action="store_true",
                   help="also read what the job reads, from here, as `diloco run` does before it starts: its data "
                        "globs, tokenizer and pretrained model's config.json (a cluster manifest's paths are the pods')")
    p.add_argument("--no-kueue", action="store_true",
                   help="the operator was installed without kueue.enabled: skip Kueue's checks of a job labelled "
                        "with a queue (by default a labelled job is checked as Kueue will see it)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("run", help="run a job on this machine: one syncer and a process per learner")
    p.add_argument("file", help="YAML manifest")
    p.add_argument("--out", default=None, help="output directory (default runs/<job name>)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live display")
    p.set_defaults(func=lambda a: _call("diloco.apps.local.runner", "main", a, needs=extras.LEARNER))

    p = sub.add_parser("learner", help="run one learner (container entry point)")
    contract.add_learner_flags(p)
    p.set_defaults(func=lambda a: _call("diloco.trainer.learner", "run", a, needs=extras.LEARNER))

    p = sub.add_parser("syncer", help="run the syncer (container entry point)")
    contract.add_syncer_flags(p)
    p.set_defaults(func=cmd_syncer)

    p = sub.add_parser("status", help="ask a syncer for its state (versions, learners, regions)")
    p.add_argument("--syncer", required=True,
                   help="syncer address host:port; for a sharded syncer every shard's, comma-separated, in order")
    contract.add_token_flag(p)
    contract.add_client_tls_flags(p)
    p.set_defaults(func=cmd_status)


def _add_model_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a syncer checkpoint's global model for transformers (hf), or as "
                                      "safetensors or orbax with our config")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                   help="the syncer's checkpoint directory; a sharded syncer's: the root holding shard-0, shard-1, ...")
    p.add_argument("out", metavar="OUT", help="directory to write the model to")
    p.add_argument("--format", choices=["safetensors", "orbax", "hf"], default="safetensors",
                   help="hf: a Hugging Face directory transformers loads (config.json, model.safetensors, tokenizer); "
                        "safetensors/orbax: our parameter names with our config.json, for `diloco sample`")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="hf: the tensors' dtype (float32: exactly what the syncer holds; bfloat16: half the size)")
    p.add_argument("--config", default=None, metavar="JOB.yaml",
                   help="the job's manifest (default: the job.yaml `diloco run` writes beside CHECKPOINT_DIR)")
    p.add_argument("--force", action="store_true", help="replace an export already in OUT")
    p.set_defaults(func=lambda a: _call("diloco.apps.export", "main", a, needs=extras.LEARNER))

    p = sub.add_parser("sample", help="generate text from an exported model or a syncer checkpoint")
    p.add_argument("export_dir", nargs="?", default=None, metavar="EXPORT_DIR", help="a `diloco export` directory")
    p.add_argument("--checkpoint", default=None, metavar="CHECKPOINT_DIR", help="sample a checkpoint instead")
    p.add_argument("--config", default=None, metavar="JOB.yaml",
                   help="with --checkpoint: the job's manifest (default: the job.yaml beside CHECKPOINT_DIR)")
    p.add_argument("--prompt", default=None, help="text to continue (default: ROMEO: on the builtin corpus)")
    p.add_argument("--tokens", type=int, default=200,
                   help="tokens to generate, at most: it stops at the end-of-text token (bytes, for a byte-level model)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sample at this temperature")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (temperature > 0)")
    p.add_argument("--tokenizer", default=None, metavar="tokenizer.json",
                   help="override the job's tokenizer (needed for pre-tokenized data with a vocabulary above 256)")
    p.set_defaults(func=lambda a: _call("diloco.apps.sample", "main", a, needs=extras.LEARNER))

    p = sub.add_parser("prepare-tokens", help="tokenize text, Parquet or JSON Lines into shards of ids (spec.data.source "
                                             "kind tokens), resumable, on every core")
    p.add_argument("glob", metavar="GLOB", help="the input files, a quoted glob, local or an fsspec URL: text, Parquet, "
                                                "or JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="local directory for train-NNNNN.bin, val-NNNNN.bin and manifest.json")
    p.add_argument("--tokenizer", default="bytes", help="a Hugging Face tokenizer.json (default: bytes, ids 0-255)")
    p.add_argument("--held-out-fraction", type=float, default=0.05,
                   help="the last fraction of the input (bytes of text; trailing row groups or ranges of records), "
                        "written to val-*.bin (default: spec.data.heldOutFraction's 0.05)")
    p.add_argument("--kind", choices=["auto", "text", "parquet", "jsonl"], default="auto",
                   help="the input's kind (default: from the file names, as .parquet, .jsonl[.gz|.zst]; else text)")
    p.add_argument("--text-field", default="text",
                   help="Parquet column or JSON Lines field holding the text (spec.data.source.textField)")
    p.add_argument("--shard-size", type=int, default=100_000_000, metavar="TOKENS",
                   help="ids per shard file (default 100M: 200 MB of uint16)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizing processes (default: one per core this process may use; 1: in this process, on the "
                        "tokenizer's threads only)")
    p.add_argument("--restart", action="store_true",
                   help="delete what an earlier run wrote in DIR and start over (default: resume it)")
    p.set_defaults(func=lambda a: _call("diloco.apps.tokens.prepare", "main", a, needs=extras.LEARNER))


def _add_cluster_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("crd", help="print the CustomResourceDefinition generated from the job spec")
    p.add_argument("--no-cel", action="store_true",
                   help="without the CEL rules on immutable fields (API servers before 1.23 reject them in kubectl's validation)")
    p.add_argument("--apply", action="store_true",
                   help="apply it to the cluster instead of printing it (server-side; in-cluster credentials, then "
                        "$KUBECONFIG; without the CEL rules on API servers before 1.23): the chart's crds.upgrade hook")
    p.set_defaults(func=lambda a: _call("diloco.operator.crd", "main", a))

    p = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    p.add_argument("--namespace", action="append", default=None,
                   help="watch this namespace; repeat it for several (default: all namespaces). The chart's "
                        "watchNamespaces sets it, beside a Role in each")
    p.add_argument("--standalone", action="store_true", help="no peering (single operator replica)")
    p.set_defaults(func=lambda a: _call("diloco.operator.main", "main", a))


def cmd_syncer(args: argparse.Namespace) -> int:
    """The syncer runs protobuf's pure-Python backend. upb, the default, calls malloc_trim(0)
    once every 10,000 message arenas it frees, which hands all the syncer's free heap back to the
    kernel, the head-room it reserved at start among it, to be faulted in again under the next
    rounds' merges (docs/BENCHMARKS.md §5). The syncer's bulk messages are framed and parsed by
    hand (diloco.wire), so what protobuf still does there is a few small headers a push."""
    os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")  # before protobuf is imported
    return _call("diloco.syncer.main", "main", args)


def _call(module: str, func: str, args: argparse.Namespace, needs: str | None = None) -> int:
    import importlib

    if needs is not None and (absent := extras.missing(needs)):
        print(extras.missing_message(args.command, needs, absent), file=sys.stderr)
        return contract.Exit.CONFIG
    return int(getattr(importlib.import_module(module), func)(args) or 0)


def cmd_validate(args: argparse.Namespace) -> int:
    """The spec's own rules, then every check the operator makes before it runs a job
    (operator/admission/checks.py), with the operator's messages; with --inputs, the files the job
    reads too (diloco/inputs.py); exit 2 on any problem."""
    from diloco import inputs
    from diloco.operator.admission import checks as spec_checks
    from diloco.spec import SpecError, load_job

    try:
        job = load_job(args.file)
        job = inputs.check(job) if args.inputs else job
    except SpecError as exc:
        problems = exc.problems
    else:
        problems = spec_checks.problems(job, gateway_api=args.gateway_api, kueue_enabled=not args.no_kueue)
        if args.inputs and not problems:
            problems = read_data(job)
    if problems:
        for line in problems:
            print(line, file=sys.stderr)
        return 2
    spec = job.spec
    print(
        f"{args.file}: valid {job.kind} {job.metadata.name!r}: "
        f"{spec.total_learners} learners in {len(spec.learner_groups)} group(s), "
        f"quorum {spec.syncer.quorum}, {spec.syncer.fragments} fragments"
        + (f" x {spec.syncer.shards} shards" if spec.syncer.shards > 1 else "") + f", {spec.syncer.compression}"
        + (f"; clusters: this one and {len(spec.clusters)} remote ({', '.join(c.name for c in spec.clusters)})"
           if spec.clusters else "")
    )
    _print_copies(spec, compared=args.inputs)
    return 0


def read_data(job: DecoupledDiLoCoJob) -> list[str]:
    """The job's data read as the learner will read it (trainer/data/probe.py, with the learner's
    own readers), as `diloco run` reads it before it starts; in an install without the readers
    (the syncer image: no tokenizers, pyarrow or zstandard), the line naming the extra that has
    them. Imported by name, as `_call` imports the learner's commands: the syncer image's commands
    import nothing of the trainer (pyproject.toml, [tool.importlinter])."""
    import importlib

    from diloco import inputs

    if not inputs.reads_data(job):
        return []
    try:
        probe = importlib.import_module("diloco.trainer.data.probe")
    except ImportError as exc:
        return [inputs.missing_reader("spec.data.source", exc.name or str(exc))]
    found: list[str] = probe.problems(job)
    return found


def _print_copies(spec: JobSpec, *, compared: bool) -> None:
    """Where the groups read their own copies of the data (docs/DATA.md, "Data near its
    learners"): each copy's files and bytes once compared (--inputs), else how to compare them."""
    from diloco import copy_listings

    if len({(d.source.path, d.source.held_out_path) for d in map(spec.data_for, (g.name for g in spec.learner_groups))}) < 2:
        return
    if compared:
        for line in copy_listings.compare_copies(spec)[1]:
            print(f"  {line}: the same files and sizes")
    else:
        print("  the groups read their own copies of the data: compare their files and sizes with --inputs "
              "(the syncer compares them at each learner's Join)")


def cmd_status(args: argparse.Namespace) -> int:
    """One syncer's status; a sharded syncer's (every shard's address, comma-separated) added
    up as one, with each shard's own under `per_shard`."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from diloco.launch import read_pem, read_token
    from diloco.shards import aggregate, server_names, syncer_addresses
    from diloco.wire import auth_metadata, channel, pb, rpc

    token, ca = read_token(args), read_pem(args.tls_ca, "--tls-ca")
    try:
        addresses = syncer_addresses(args.syncer)
        names = server_names(args.tls_server_name, addresses)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    replies = []
    for address, name in zip(addresses, names, strict=True):
        opened = channel(address, ca, name)
        try:
            replies.append(rpc.SyncerStub(opened).Status(pb.StatusRequest(), metadata=auth_metadata(token), timeout=10))
        except grpc.RpcError as exc:
            print(f"syncer {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        finally:
            opened.close()
    out = MessageToDict(aggregate(replies), preserving_proto_field_name=True)
    if len(replies) > 1:
        out["per_shard"] = [MessageToDict(r, preserving_proto_field_name=True) for r in replies]
    print(json.dumps(out, indent=2))
    return 0
