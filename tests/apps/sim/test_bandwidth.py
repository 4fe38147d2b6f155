"""The bandwidth model reproduces the paper's 104 / 1.7 / 0.43 GB/s and behaves like its formulas."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from diloco.apps.sim import cli
from diloco.apps.sim.bandwidth import BITS_PER_PARAM, BandwidthParams, bandwidth_gb_s
from diloco.core.codecs import encoded_size

PAPER = {"dp": 104.0, "decoupled_bf16": 1.7, "decoupled_int4": 0.43}
BASE = BandwidthParams()


@pytest.mark.parametrize("key", sorted(PAPER))
def test_paper_example_within_15_percent(key: str) -> None:
    got = bandwidth_gb_s(BandwidthParams(params=5e9, step_s=1.0, sites=2, utilization=0.9))[key]
    assert got == pytest.approx(PAPER[key], rel=0.15)


def test_dp_formula() -> None:
    # ring all-reduce of 2-byte gradients in the 10% of a 1 s step left by 90% utilization
    assert bandwidth_gb_s(BASE)["dp"] == pytest.approx(5e9 * 2 / 0.1 / 1e9)
    assert bandwidth_gb_s(replace(BASE, sites=4))["dp"] == pytest.approx(1.5 * 100.0)
    assert bandwidth_gb_s(replace(BASE, utilization=0.8))["dp"] == pytest.approx(50.0)
    assert bandwidth_gb_s(replace(BASE, params=1e10, step_s=2.0))["dp"] == pytest.approx(100.0)


def test_decoupled_formula() -> None:
    got = bandwidth_gb_s(BASE)
    assert got["decoupled_bf16"] == pytest.approx(5e9 / 6 * 2 / 1e9)
    assert got["decoupled_int4"] / got["decoupled_bf16"] == pytest.approx(4.5 / 16)
    halved = bandwidth_gb_s(replace(BASE, fragments=12))
    assert halved["decoupled_bf16"] == pytest.approx(got["decoupled_bf16"] / 2)
    # tau >= 2 leaves room for the round trip; tau = 1 needs both transfers inside one step
    assert bandwidth_gb_s(replace(BASE, tau=4))["decoupled_bf16"] == got["decoupled_bf16"]
    assert bandwidth_gb_s(replace(BASE, tau=1))["decoupled_bf16"] == pytest.approx(2 * got["decoupled_bf16"])
    # the method's point: two orders of magnitude less than data-parallel
    assert got["dp"] / got["decoupled_int4"] > 100


def test_one_site_needs_no_wan() -> None:
    assert set(bandwidth_gb_s(replace(BASE, sites=1)).values()) == {0.0}


def test_int4_bits_match_the_real_wire_format() -> None:
    n = 64 * 100_000
    for codec in ("bf16", "int8", "int4", "nf4"):
        assert encoded_size((n,), codec) * 8 / n == pytest.approx(BITS_PER_PARAM[codec], rel=1e-3)


@pytest.mark.parametrize("field, value", [("params", 0), ("utilization", 1.0), ("sites", 0),
                                          ("fragments", 0), ("tau", 0.0), ("step_s", -1.0)])
def test_invalid_params_are_named(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        bandwidth_gb_s(replace(BASE, **{field: value}))


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="diloco")
    cli.add_bandwidth_parser(parser.add_subparsers(required=True))
    try:
        args = parser.parse_args(argv)
        code = args.func(args)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json(capsys) -> None:
    code, out, _ = run_cli(["bandwidth", "--params", "5e9", "--step-seconds", "1", "--sites", "2",
                            "--utilization", "0.9", "--fragments", "6", "--tau", "2", "--json"], capsys)
    assert code == 0
    got = json.loads(out)
    assert set(got) == set(PAPER)
    assert got["dp"] == pytest.approx(100.0) and got["decoupled_int4"] == pytest.approx(0.46875)


def test_cli_table(capsys) -> None:
    code, out, _ = run_cli(["bandwidth"], capsys)
    assert code == 0 and "decoupled_int4" in out and "Gbit/s" in out


@pytest.mark.parametrize("argv, option", [(["--utilization", "1.5"], "--utilization"),
                                          (["--params", "-5e9"], "--params"),
                                          (["--sites", "0"], "--sites"),
                                          (["--fragments", "two"], "--fragments")])
def test_cli_rejects_bad_options(argv: list[str], option: str, capsys) -> None:
    code, _, err = run_cli(["bandwidth", *argv], capsys)
    assert code == 2 and option in err
