"""Test hosts left by a session that was interrupted (``netns_hosts.sweep_orphans``): the
next session removes them, names and processes, and never a live session's.

Root only (skipped with the reason elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.netns_hosts import TestHosts, sweep_orphans, unavailable

pytestmark = [pytest.mark.netns]


def test_hosts_whose_session_is_gone_are_swept_and_a_live_session_s_kept(
    tmp_path: Path,
) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    mine, orphan = TestHosts(1), TestHosts(1)
    try:
        mine.up(tmp_path, ray=False)
        orphan.up(tmp_path, ray=False)
        # The orphan's owner: a process that has ended (an interrupted session).
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        record = orphan._record()
        owner = json.loads(record.read_text())
        record.write_text(json.dumps({**owner, "pid": int(gone.stdout)}))
        assert orphan.tag in sweep_orphans()
        assert orphan.left() == [] and not record.exists()
        assert orphan.anchors[1].wait(10) is not None, "its processes were killed"
        assert mine.left() != [], "a live session's hosts stay"
    finally:
        mine.down()
        orphan.down()
    assert mine.left() == []
