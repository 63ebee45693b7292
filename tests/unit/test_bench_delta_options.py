"""``disagg bench delta``'s flags: bad values exit 2 naming the flag and the value, before any process starts."""

from __future__ import annotations

import pytest

from disagg.bench.delta import DeltaOptions, main, parse_args


def test_flags_parse_into_the_options():
    opts, out = parse_args(["--shape", "qwen2-0.5b", "--steps", "7", "--lr", "3e-6", "--nccl-socket", "--json", "x.json"])
    assert (opts.shape, opts.steps, opts.lr, opts.nccl_socket, out) == ("qwen2-0.5b", 7, 3e-6, True, "x.json")
    assert parse_args([])[0] == DeltaOptions()


@pytest.mark.parametrize("argv, message", [
    (["--shape", "nope"], "unknown shape 'nope'; known shapes: qwen2-0.5b"),
    (["--steps", "0"], "--steps, --lr and --bucket-mb must be positive (got 0, 1e-06, 64)"),
    (["--lr", "-1"], "(got 10, -1.0, 64)"),
    (["--device", "tpu"], "--device must be cpu, cuda or auto, got 'tpu'"),
])
def test_bad_values_exit_2_with_the_flag_and_the_value(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
