"""core.files.FileSource woken by inotify: every way a file changes (written in place, replaced by an
atomic rename, created, removed, renamed away, in a directory that appears later) reaches
`on_change` without the safety poll; `stop` ends `run` at once; without inotify it polls as before.

The safety poll and the polling interval are set to a minute here, so a change seen within the
wait below can only have come from inotify; the waits are upper bounds for failing, not timings.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from pathlib import Path

import pytest

from core import files
from core.files import FileSource

WAIT_S = 20.0
POD = """apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: team-a, annotations: {netagent.io/egress-class: %s}}
spec: {nodeName: n1}
status: {phase: Running, podIP: 10.244.0.11, podIPs: [{ip: 10.244.0.11}]}
"""


class Running:
    """A FileSource's `run` on a thread; `next()` is the next snapshot it handed on."""

    def __init__(self, paths, interval=60.0, safety_poll=60.0):
        self.source = FileSource([str(p) for p in paths], node="n1", interval=interval, safety_poll=safety_poll)
        self.snapshots: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self.source.run, args=(self.snapshots.put,), daemon=True)
        self.thread.start()
        self.first = self.next()

    def next(self):
        return self.snapshots.get(timeout=WAIT_S)

    def pods(self, snap) -> dict[str, str]:
        return {p.name: p.annotation("netagent.io/egress-class") for p in snap.pods}

    def stop(self) -> None:
        self.source.stop()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "run() did not end on stop()"


@pytest.fixture
def running():
    started: list[Running] = []

    def start(*args, **kw) -> Running:
        r = Running(*args, **kw)
        started.append(r)
        return r
    yield start
    for r in started:
        if r.thread.is_alive():
            r.stop()


def test_every_kind_of_change_wakes_the_source_without_polling(tmp_path, running):
    f = tmp_path / "pods.yaml"
    f.write_text(POD % ("a", "bulk"))
    r = running([f])
    assert r.source.watching and r.pods(r.first) == {"a": "bulk"}

    f.write_text(POD % ("a", "interactive"))  # in place: IN_CLOSE_WRITE
    assert r.pods(r.next()) == {"a": "interactive"}

    tmp = tmp_path / "pods.tmp"
    tmp.write_text(POD % ("b", "bulk"))
    os.replace(tmp, f)  # an atomic rename, as editors and the benchmark do: IN_MOVED_TO
    assert r.pods(r.next()) == {"b": "bulk"}

    os.rename(f, tmp_path / "pods.old")  # renamed away: IN_MOVED_FROM
    snap = r.next()
    assert r.pods(snap) == {} and any("not found" in e for e in snap.errors)

    os.rename(tmp_path / "pods.old", f)
    assert r.pods(r.next()) == {"b": "bulk"}
    f.unlink()  # IN_DELETE
    assert r.pods(r.next()) == {}


def test_a_directory_of_files_sees_new_and_removed_files(tmp_path, running):
    (tmp_path / "a.yaml").write_text(POD % ("a", "bulk"))
    r = running([tmp_path])
    assert r.pods(r.first) == {"a": "bulk"}
    (tmp_path / "b.yaml").write_text(POD % ("b", "bulk"))  # IN_CREATE, then IN_CLOSE_WRITE
    snap = r.next()
    while set(r.pods(snap)) != {"a", "b"}:  # the create may be seen before the content
        snap = r.next()
    (tmp_path / "a.yaml").unlink()
    assert r.pods(r.next()) == {"b": "bulk"}


def test_a_bad_edit_keeps_the_last_good_content_and_the_source_running(tmp_path, running):
    f = tmp_path / "pods.yaml"
    f.write_text(POD % ("a", "bulk"))
    r = running([f])
    for content in (b"kind: Pod\nmetadata: {name: [broken", b"\xff\xfe not text \x00", b"- a list\n",
                    (POD % ("a", "interactive")).encode()):
        (tmp_path / "pods.tmp").write_bytes(content)
        os.replace(tmp_path / "pods.tmp", f)
    snap = r.next()
    while r.pods(snap) != {"a": "interactive"}:
        assert r.pods(snap) == {"a": "bulk"}  # never dropped by the broken versions
        snap = r.next()
    assert r.thread.is_alive()


def test_a_directory_that_appears_later_is_watched_once_it_exists(tmp_path, running):
    d = tmp_path / "later"
    r = running([d / "pods.yaml"], interval=0.05)  # no directory to watch yet: it polls until there is
    assert not r.first.pods
    d.mkdir()
    (d / "pods.yaml").write_text(POD % ("a", "bulk"))
    snap = r.next()
    while not snap.pods:
        snap = r.next()
    assert r.source._inotify is not None and r.source._inotify.complete
    r.source.interval = 60.0  # watched now: a change must arrive without the poll
    (d / "pods.yaml").write_text(POD % ("a", "interactive"))
    snap = r.next()
    while r.pods(snap) != {"a": "interactive"}:
        snap = r.next()


def test_stop_ends_run_without_waiting_for_the_safety_poll(tmp_path, running):
    f = tmp_path / "pods.yaml"
    f.write_text(POD % ("a", "bulk"))
    r = running([f], safety_poll=3600.0)
    r.stop()  # joined within WAIT_S, far under the poll


def test_without_inotify_it_polls_and_says_so_once(tmp_path, running, monkeypatch, caplog):
    def unavailable():
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(files, "Inotify", unavailable)
    monkeypatch.setattr(files, "_fallback_logged", False)
    f = tmp_path / "pods.yaml"
    f.write_text(POD % ("a", "bulk"))
    with caplog.at_level(logging.WARNING, logger="core.files"):
        r = running([f], interval=0.05)
        r2 = running([f], interval=0.05)
        assert not r.source.watching
        f.write_text(POD % ("a", "interactive"))
        assert r.pods(r.next()) == {"a": "interactive"}
        assert r2.pods(r2.next()) == {"a": "interactive"}
    assert sum("inotify unavailable" in m for m in caplog.messages) == 1


NAMESPACES = """apiVersion: v1
kind: Namespace
metadata: {name: team-a, labels: {netagent.io/team: research}}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-b}
"""


def test_namespace_objects_give_their_labels_and_without_them_namespaces_are_unknown(tmp_path):
    """Single-machine mode takes Namespaces with labels (teams chosen by namespaceSelector); files without
    any Namespace leave the labels unknown (None: every namespace resolves by its name alone, on the agent as
    on the controller's --from-file)."""
    pods = tmp_path / "pods.yaml"
    pods.write_text(POD % ("p", "gold"))
    assert FileSource([str(pods)], node="n1").load()[0].namespaces is None
    (tmp_path / "ns.yaml").write_text(NAMESPACES + "---\napiVersion: v1\nkind: Namespace\nmetadata: {labels: {a: b}}\n")
    snap, _ = FileSource([str(tmp_path)], node="n1").load()
    assert snap.namespaces == {"team-a": {"netagent.io/team": "research"}, "team-b": {}}
    assert any("Namespace without metadata.name" in e for e in snap.errors)


def test_run_from_a_path_that_does_not_exist_refuses_to_start_naming_it(tmp_path):
    """`netagent run --from-file` with a typo refuses to start, naming the path (it used to start with no pods
    and program the node's uplink anyway). Run in a network namespace of its own, created for it and gone with
    it: were the refusal ever lost, nothing of the host's would be touched."""
    import subprocess
    import sys

    from lab.netns import require_root

    require_root()
    typo = tmp_path / "polcy.yaml"
    (tmp_path / "policy.yaml").write_text(NAMESPACES)
    proc = subprocess.run(["unshare", "--net", sys.executable, "-m", "netagent", "run", "--from-file",
                           str(tmp_path / "policy.yaml"), "--from-file", str(typo)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"--from-file {typo}: no such file or directory" in proc.stderr
    assert "cannot start" in proc.stderr
