"""A peer that goes silent without a FIN (the link down, every packet lost) is noticed
within the stated bound (``streams.SILENT_PEER_S``: kernel keepalive and
``TCP_USER_TIMEOUT`` on every TCP edge), not waited on for the run's minute-long step
and edge timeouts. Needs root, for a network namespace of its own (``unshare -n``),
whose loopback the test takes down; it leaves no namespace behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_cupy.process.streams import SILENT_PEER_S
from tests.runtime_cupy.test_process_cli import _env
from tests.support.hygiene import learn_chain_ids, run_resources

#: A network namespace and real stage processes (make fast leaves these out).
pytestmark = [pytest.mark.netns, pytest.mark.process]

SCRIPT = Path(__file__).parents[1] / "support" / "silent_peer.py"


def _no_namespace() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a network namespace of its own (unshare -n)"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"unshare -n is refused here: {probe.stderr.decode().strip()}"
    return None


def test_a_link_cut_mid_decode_is_noticed_within_the_bound(tiny: str) -> None:
    reason = _no_namespace()
    if reason is not None:
        pytest.skip(reason)
    proc = subprocess.run(
        ["unshare", "-n", sys.executable, str(SCRIPT), tiny],
        capture_output=True, text=True, check=False, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    learn_chain_ids([doc["chain_id"]])
    assert doc["outcome"] == "faulted", doc
    assert doc["tokens"] == 2  # nothing after the cut
    assert "timed out" in doc["fault"] or "broke" in doc["fault"], doc
    # Noticed within the bound, plus teardown (stop timeout 3 s) and a loaded machine's
    # slack; the run's own step and edge timeouts are 60 s.
    assert doc["after_cut_s"] < SILENT_PEER_S + 3 + 20, doc
    assert all(code == 0 for code in doc["returncodes"]), doc  # each stopped on StopRun
    assert run_resources(doc["chain_id"]) == []
