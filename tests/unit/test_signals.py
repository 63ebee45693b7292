"""A member's doorbell and the bells that ring it, over real loopback sockets (``transport.signals=socket``)."""

from __future__ import annotations

import threading
import time

import pytest

from disagg.transport.signals import BellError, Bells, Doorbell, encode, parse_address

HOST = "127.0.0.1"


@pytest.fixture
def bell():
    b = Doorbell(HOST)
    yield b
    b.close()


def test_a_word_rung_before_the_wait_is_kept_and_another_keys_word_waits_for_its_own_wait(bell):
    driver = Bells([bell.address], "driver", 5.0)
    assert driver.ring({"go/1": "send", "arm/1": "send"}) == []
    assert bell.wait("arm/1", 5.0) == "send"  # rung before anyone waited
    assert bell.wait("go/1", 5.0) == "send"  # read along with arm/1's, kept for this wait
    with pytest.raises(BellError) as e:  # taken: a second wait for it waits again
        bell.wait("go/1", 0.2)
    assert not e.value.gone and "go/1" in str(e.value)
    driver.close()


def test_a_wait_wakes_on_a_word_rung_while_it_waits_from_any_of_its_ringers(bell):
    rank0, driver = Bells([bell.address], "rank 0", 5.0), Bells([bell.address], "driver", 5.0)
    said = {}

    def later():
        time.sleep(0.3)
        said["at"] = time.monotonic()
        driver.ring({"go/7": "cancel"})

    threading.Thread(target=later).start()
    assert bell.wait("go/7", 5.0) == "cancel"
    assert time.monotonic() - said["at"] < 0.2  # woken by the word, not by a poll's period
    assert rank0.ring({"arm/8": "a value with spaces"}) == []
    assert bell.wait("arm/8", 5.0) == "a value with spaces"
    rank0.close(), driver.close()


def test_rank_0_hanging_up_ends_a_wait_at_once_and_its_last_words_still_count(bell):
    rank0 = Bells([bell.address], "rank 0", 5.0)
    rank0.ring({"facts": "{}"})
    rank0.close()  # its process ended
    assert bell.wait("facts", 5.0) == "{}"  # said before it hung up
    t0 = time.monotonic()
    with pytest.raises(BellError) as e:
        bell.wait("arm/3", 30.0)
    assert e.value.gone and time.monotonic() - t0 < 5.0


def test_a_driver_hanging_up_is_no_member_gone_and_the_wait_runs_to_its_timeout_logging_progress(bell):
    driver = Bells([bell.address], "driver", 5.0)
    driver.close()
    waited = []
    t0 = time.monotonic()
    with pytest.raises(BellError) as e:
        bell.wait("go/2", 0.6, progress=waited.append, progress_s=0.2)
    assert not e.value.gone and time.monotonic() - t0 >= 0.6
    assert len(waited) >= 2 and waited == sorted(waited) and waited[0] >= 0.2


def test_a_doorbell_that_closed_is_reported_by_the_ring_and_not_rung_again():
    gone, alive = Doorbell(HOST), Doorbell(HOST)
    bells = Bells([gone.address, alive.address], "rank 0", 5.0)
    gone.close()
    failed: list[str] = []
    for _ in range(20):  # the first write after a peer closed may still be taken by the kernel
        failed = bells.ring({"arm/1": "send"})
        if failed:
            break
        time.sleep(0.05)
    assert len(failed) == 1 and f"{gone.address[1]}" in failed[0], failed
    assert bells.ring({"arm/2": "send"}) == [f"{gone.address[0]}:{gone.address[1]}: hung up before"]
    assert alive.wait("arm/2", 5.0) == "send"
    bells.close(), alive.close()


def test_words_must_be_one_token_and_one_line_and_addresses_keep_ipv6_colons():
    assert encode({"go/1": "send", "facts": '{"a": 1}'}) == b'go/1 send\nfacts {"a": 1}\n'
    with pytest.raises(ValueError, match="'go 1'"):
        encode({"go 1": "send"})
    with pytest.raises(ValueError, match="two"):
        encode({"facts": "two\nlines"})
    assert parse_address("10.0.0.2:4567") == ("10.0.0.2", 4567)
    assert parse_address("fe80::1:4567") == ("fe80::1", 4567)


def test_a_doorbell_closed_by_another_thread_ends_the_wait_there_with_an_error_not_a_hang():
    bell = Doorbell(HOST)
    threading.Timer(0.3, bell.close).start()  # its group destroyed while a member waits on it
    t0 = time.monotonic()
    with pytest.raises(BellError, match="closed while waiting for 'arm/5'"):
        bell.wait("arm/5", 30.0)  # woken by the close, not by its next progress tick (10 s)
    assert time.monotonic() - t0 < 5.0


def test_a_groups_wait_on_its_doorbell_says_which_word_timed_out_and_that_a_destroy_ended_it():
    """``TransportGroup.await_signal`` with ``signals=socket``, on a real one-member gloo group: the
    timeout names the word and its seconds; the group destroyed while a thread waits ends that wait
    at once with that said, not as a timeout."""
    from disagg.errors import TransportError
    from disagg.transport.group import create_group, pick_free_port

    group = create_group(host=HOST, port=pick_free_port(HOST), rank=0, world_size=1, backend="gloo", timeout_s=30.0,
                         group_name="bell-test", signals="socket")
    try:
        with pytest.raises(TransportError, match=r"waiting for the driver's go: no word 'go/3' within 0\.3 s"):
            group.await_signal("go/3", 0.3, "the driver's go")
        threading.Timer(0.3, group.destroy).start()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="doorbell was closed while waiting for 'go/4'"):
            group.await_signal("go/4", 30.0, "the driver's go")
        assert time.monotonic() - t0 < 5.0
    finally:
        group.destroy()
