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


def test_auto_replay_sums_the_times_of_what_the_chooser_picks():
    from disagg.bench.delta import replay_auto

    def rows(dense_s: float, delta_s: float, estimate_s: float | None, n: int = 12) -> list[dict]:
        guess = {} if estimate_s is None else {"estimate_s": estimate_s, "estimate_share": 0.04}
        return [{"dense_s": dense_s, "delta_s": delta_s, "dense_send_s": dense_s, "delta_send_s": delta_s,
                 "dense_bytes": 1000, "delta_bytes": 40, **guess} for _ in range(n)]

    fast_link = replay_auto(rows(0.015, 0.045, 0.03))  # NVLink: the estimate says a delta cannot win
    assert fast_link["choices"] == ["dense"] * 12 and fast_link["dense_vs_auto"] == pytest.approx(1.0)
    unknown = replay_auto(rows(0.015, 0.045, None))  # no estimate: one delta, measured, then dense
    assert unknown["choices"] == ["dense", "dense", "delta"] + ["dense"] * 9
    assert unknown["seconds"] == pytest.approx(11 * 0.015 + 0.045)
    slow_link = replay_auto(rows(0.7, 0.07, 0.03))  # sockets: deltas, dense tried again after 8 in a row
    assert slow_link["choices"] == ["dense"] * 2 + ["delta"] * 8 + ["dense"] + ["delta"]
    assert slow_link["dense_vs_auto"] == pytest.approx(12 * 0.7 / (3 * 0.7 + 9 * 0.07))


def test_one_read_is_off_unless_asked():
    assert parse_args([])[0].one_read is False
    assert parse_args(["--one-read"])[0].one_read is True
    assert parse_args(["--no-one-read"])[0].one_read is False
