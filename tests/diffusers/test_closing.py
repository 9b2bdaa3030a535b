"""The end of a request (`offload_core.diffusers.closing`): what a store that cannot report still says."""

import logging

from offload_core.diffusers import closing


class Unreadable:
    """A store whose `stats()` fails (e.g. closed under the reader by another thread)."""

    name, closed = "cond", False

    def stats(self):
        raise RuntimeError("no figures")

    def close(self):
        self.closed = True


def test_a_store_without_figures_reports_its_mode_as_unknown_and_is_closed_all_the_same(caplog):
    store, errors = Unreadable(), []
    (entry,) = closing.close_or_keep(None, [store], {}, {}, None, errors)
    assert entry["mode"] is None and entry["tier"] is None  # "tier": the deprecated alias, kept for one release
    assert store.closed and [str(e) for e in errors] == ["no figures"]
    with caplog.at_level(logging.INFO, logger="offload_core.diffusers.closing"):
        closing.log_summary([entry])
    assert "cond=None" in caplog.text
