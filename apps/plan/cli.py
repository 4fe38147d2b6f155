"""`diloco plan`: its flags, the regions' parsing, and the handler.

Every bad input ends as a plan whose problems say what to change (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.apps.plan.inputs import PlanInput, Region
from diloco.apps.plan.model import MIN_FRAGMENTS

if TYPE_CHECKING:
    from diloco.spec import TransformerModel

_KEYS = {"name": "name", "step-time": "step_s", "wan-gbps": "wan_gbps", "latency-ms": "latency_ms",
         "failure-rate": "failure_rate", "learners": "learners", "chips": "chips"}
_INTS = {"learners", "chips"}
_DEFAULTS = PlanInput(params=1.0, regions=())


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="size a multi-region run from measured parts: learners, fragments, syncer "
                                    "shards and hosts, WAN per region, checkpoints, goodput; --manifest writes it")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="model parameters, e.g. 12e9 (a Llama shape of that size)")
    size.add_argument("--from", dest="from_manifest", metavar="JOB.yaml",
                      help="take spec.model (and spec.data, spec.training) from this manifest")
    p.add_argument("--region", action="append", default=[], metavar="KEY=VALUE,...",
                   help="a region, repeatable: name=us-east,learners=2,chips=4096,step-time=1.0,wan-gbps=2.5,"
                        "latency-ms=30,failure-rate=1 (interruptions per chip-year); the first hosts the syncer")
    p.add_argument("--regions", metavar="REGIONS.yaml", help="the regions as a YAML list of the same keys")
    p.add_argument("--utilization", type=float, default=_DEFAULTS.utilization,
                   help="target goodput, and data-parallel's compute share in the comparison (default: the paper's 0.9)")
    p.add_argument("--fragments", type=int, default=None,
                   help=f"fix P (default: the smallest from {MIN_FRAGMENTS} up that every link carries)")
    p.add_argument("--link-share", type=float, default=_DEFAULTS.link_share,
                   help="the most of a link the plan may use (default 0.8)")
    p.add_argument("--tau", type=int, default=_DEFAULTS.tau, help="steps a fragment may be in flight (default 2)")
    p.add_argument("--host-cores", type=int, default=_DEFAULTS.host_cores, help="cores of a syncer host (32)")
    p.add_argument("--host-memory-gb", type=float, default=_DEFAULTS.host_memory_gb, help="its memory (256 GB)")
    p.add_argument("--cores-per-shard", type=int, default=_DEFAULTS.cores_per_shard,
                   help="cores per syncer shard (default 1, as measured in BENCHMARKS §5)")
    p.add_argument("--syncer-region", default=None, help="the region hosting the syncer (default: the first)")
    p.add_argument("--days", type=float, default=_DEFAULTS.days, help="days the goodput simulator runs (7)")
    p.add_argument("--seeds", type=int, default=_DEFAULTS.seeds, help="its runs per region (2)")
    p.add_argument("--name", default="plan", help="the job's metadata.name in --manifest (default plan)")
    p.add_argument("--manifest", metavar="OUT.yaml", default=None,
                   help="write the one DecoupledDiLoCoJob that runs the plan here, checked as `diloco validate` "
                        "checks it; across regions, applied on the syncer's cluster, which runs the other regions' "
                        "parts (spec.clusters)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=main)


def parse_region(text: str) -> Region:
    """`name=us-east,wan-gbps=2.5,...` -> Region; ValueError names the bad key."""
    fields: dict[str, Any] = {}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, value = part.partition("=")
        fields.update(_field(key.strip(), value.strip(), sep))
    return _region(fields, text)


def _field(key: str, value: str, sep: str = "=") -> dict[str, Any]:
    if key not in _KEYS or not sep:
        raise ValueError(f"--region: {key!r} is not a key; use {', '.join(_KEYS)} (key=value, comma-separated)")
    if key == "name":
        return {"name": value}
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"--region: {key}={value!r} is not a number") from None
    if key in _INTS:
        if number != int(number):
            raise ValueError(f"--region: {key}={value} must be a whole number")
        return {_KEYS[key]: int(number)}
    return {_KEYS[key]: number}


def _region(fields: dict[str, Any], where: str) -> Region:
    if not fields.get("name"):
        raise ValueError(f"--region {where!r}: give it a name=...")
    return Region(**fields)


def load_regions(path: str) -> list[Region]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"--regions {path}: cannot read: {exc}") from None
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise ValueError(f"--regions {path}: expected a YAML list of mappings (name: us-east, wan-gbps: 2.5, ...)")
    out = []
    for item in data:
        fields: dict[str, Any] = {}
        for key, value in item.items():
            fields.update(_field(str(key), str(value)))
        out.append(_region(fields, str(item)))
    return out


def main(args: argparse.Namespace) -> int:
    from diloco.apps.plan import render, sizing
    from diloco.apps.plan.model import make_plan
    from diloco.spec import SpecError

    base: dict[str, Any] | None = None
    cfg: TransformerModel | None
    try:
        regions = [parse_region(r) for r in args.region] + (load_regions(args.regions) if args.regions else [])
        if args.from_manifest:
            cfg = sizing.model_from_manifest(args.from_manifest)
            base = _base_spec(args.from_manifest)
        else:
            cfg = sizing.llama_of_size(args.params) if 0 < args.params < math.inf else None
            if cfg is None and args.params > 0:
                raise ValueError(f"--params: no Llama shape of {args.params:g} parameters; give a size from 1e8 "
                                 "to 1e12, or --from a manifest whose spec.model is the model")
    except (ValueError, SpecError, TypeError) as exc:
        return _refuse(args, [str(exc)])
    params = float(sizing.parameters(cfg)) if cfg is not None and args.from_manifest else float(args.params or 0)
    inputs = PlanInput(params=params, regions=tuple(regions), utilization=args.utilization, fragments=args.fragments,
                       link_share=args.link_share, tau=args.tau, host_cores=args.host_cores,
                       host_memory_gb=args.host_memory_gb, cores_per_shard=args.cores_per_shard,
                       syncer_region=args.syncer_region, days=args.days, seeds=args.seeds,
                       max_fragments=sizing.tensor_count(cfg) if cfg is not None else 1)
    if args.syncer_region:  # the home region first, as the manifests and the table read
        inputs = PlanInput(**{**vars(inputs), "regions": tuple(sorted(regions, key=lambda r: r.name != args.syncer_region))})
    plan = make_plan(inputs, sizing.fragment_sizer(cfg) if cfg is not None else (lambda n: params))
    desc = "none" if cfg is None else f"{cfg.family} {cfg.layers} layers x {cfg.d_model}, " \
                                      f"{sizing.tensor_count(cfg)} tensors, {sizing.parameters(cfg) / 1e9:.3g}B"
    written: list[str] = []
    if not plan.problems and args.manifest and cfg is not None:
        problems, written = _write(plan, cfg, args, base)
        if problems:
            plan = type(plan)(plan.inputs, problems)
    if args.json:
        print(json.dumps({**render.as_json(plan, desc), "manifests": written}, indent=2))
    else:
        print(render.text(plan, desc))
        for path in written:
            print(f"wrote {path}")
    return 2 if plan.problems else 0


def _refuse(args: argparse.Namespace, problems: list[str]) -> int:
    if args.json:
        print(json.dumps({"problems": problems}, indent=2))
    else:
        print("cannot plan this run; change:\n" + "\n".join(f"  - {p}" for p in problems))
    return 2


def _base_spec(path: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    spec = data.get("spec", {}) if isinstance(data, dict) else {}
    return {k: spec[k] for k in ("data", "training") if k in spec}


def _write(plan: Any, cfg: Any, args: argparse.Namespace, base: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """Check the job as `diloco validate` does, then write it; (problems, paths)."""
    import yaml

    from diloco.apps.plan import render
    from diloco.operator.admission import checks as spec_checks
    from diloco.spec import SpecError, parse_job

    doc = render.manifest(plan, cfg, args.name, base)
    try:
        problems = [f"manifest: {x}" for x in
                    spec_checks.problems(parse_job(doc), gateway_api=False, kueue_enabled=True)]
    except SpecError as exc:
        problems = [f"manifest: {x}" for x in exc.problems]
    if problems:
        return problems, []
    home = next(rp.region.name for rp in plan.regions if not rp.remote)
    clusters = doc["spec"].get("clusters", [])
    if clusters:
        expose = doc["spec"]["syncer"]["expose"]
        head = (f"# diloco plan: one job across {len(plan.regions)} regions. Apply it on {home}'s cluster, the home\n"
                "# one (the syncer's); its operator writes each other region's learners-only part into that\n"
                "# region's cluster (spec.clusters; docs/MULTI_CLUSTER.md). First, in the operator's namespace,\n"
                f"# a kubeconfig Secret per cluster ({', '.join(c['kubeconfigSecret'] for c in clusters)});\n"
                f"# in the job's, the TLS Secret {expose['tls']['secretName']} for *.{expose['host']}\n"
                f"# (replace the example host), with DNS for shard-0 .. shard-{plan.shards - 1}.<host>.\n"
                "# Fill in each group's image, nodeSelector, tolerations and accelerator resources.\n")
    else:
        head = (f"# diloco plan: {home}, one cluster (docs/PLANNING.md). Fill in each group's image, nodeSelector,\n"
                "# tolerations and accelerator resources before applying.\n")
    out = Path(args.manifest)
    try:
        out.write_text(head + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    except OSError as exc:
        return [f"--manifest {out}: cannot write: {exc}"], []
    return [], [str(out)]
