"""DCP's per-tensor DEBUG records are not built when nobody listens to them, and a
handler a user added for DCP's telemetry is left alone."""

from __future__ import annotations

import logging

from ckptvault.io import dcp_io


def test_an_unheard_dcp_logger_builds_no_records_and_a_heard_one_is_left_alone():
    unheard = logging.getLogger("c10d-test-unheard")
    unheard.setLevel(logging.DEBUG)
    unheard.addHandler(logging.NullHandler())
    heard = logging.getLogger("c10d-test-heard")
    heard.setLevel(logging.DEBUG)
    heard.addHandler(logging.StreamHandler())
    dcp_io._quiet_unheard_dcp_logger()
    assert not unheard.isEnabledFor(logging.DEBUG)
    assert heard.isEnabledFor(logging.DEBUG)
    dcp_logger = logging.getLogger("c10d-NullHandler-dcp_logger")
    assert not dcp_logger.isEnabledFor(logging.DEBUG)  # torch's own, after import
