"""The front end's record of live flag changes, replayed on a restarted replica: one entry per flag however many
changes are made, the latest value of each, all in one call."""

from __future__ import annotations

from nanoserve.dp.live_flags import LiveFlags


def test_many_changes_keep_one_entry_per_flag_with_its_latest_value():
    flags = LiveFlags()
    assert flags.replay() is None  # nothing changed: nothing to replay
    for i in range(10_000):
        flags.add({"max_num_seqs": i % 7 + 1}, f"caller {i % 3}")
        flags.add({"max_step_ms": float(i)}, "console")
    flags.add({"max_num_seqs": 5, "log_level": "DEBUG"}, "api")
    assert len(flags) == 3
    changes, who = flags.replay()
    assert changes == {"max_step_ms": 9999.0, "max_num_seqs": 5, "log_level": "DEBUG"}
    assert who == "console, api (replayed on restart)"
