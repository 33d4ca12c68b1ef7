"""`--from-file`: Pods, Namespaces, EgressClasses and EgressBudgets from YAML, reloaded when they change.

This is how one machine with no cluster runs netagent (and how the demo runs). Files
hold objects in exactly their Kubernetes form, several per file (`---`). A file that
fails to parse keeps its last good content: a typo while editing never drops pods.

`FileSource.run` waits on inotify (the watched files' directories, through ctypes: the core
stays stdlib-only) and re-reads on an event, on a slow safety poll, or ends on `stop`; where
inotify is unavailable (no such call, or the user's inotify instances used up) it polls the
files' modification times every `interval` as before, and says so once in the log.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
from pathlib import Path
from typing import Callable

import yaml

from .objects import SCOPES_NAME, PodRecord, Snapshot, namespace_labels, node_zone_of

log = logging.getLogger(__name__)
KINDS = {"Pod", "Namespace", "EgressClass", "EgressBudget"}
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: ~5x faster on 110 pods


def yaml_files(paths: list[str] | list[Path]) -> list[Path]:
    """The files named, with directories replaced by their *.yaml, *.yml and *.json files (sorted)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml", ".json") and q.is_file())
        else:
            out.append(p)
    return out


def parse_documents(text: str, origin: str) -> list[dict]:
    """Kubernetes objects from YAML text (several documents; `kind: List` flattened). Raises
    ValueError naming `origin` (and the line, for a YAML syntax error)."""
    docs = []
    try:
        loaded = list(yaml.load_all(text, Loader=SAFE_LOADER))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}" if mark is not None else origin
        raise ValueError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    for i, doc in enumerate(loaded):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ValueError(f"{origin}: document {i + 1} must be a Kubernetes object, got {doc!r:.60}")
        if doc.get("kind") == "List":
            docs += [d for d in doc.get("items") or [] if isinstance(d, dict)]
        else:
            docs.append(doc)
    return docs


def missing_paths(paths: list[str]) -> list[str]:
    """The paths named that do not exist: a typo must not start a node with no pods and its uplink
    programmed anyway (the caller refuses to start, naming them)."""
    return [p for p in paths if not Path(p).exists()]


def load_objects(paths: list[str] | list[Path]) -> list[dict]:
    """Every object in the files (see `yaml_files`); ValueError naming the file that cannot be read."""
    out: list[dict] = []
    for f in yaml_files(paths):
        try:
            text = f.read_text()
        except OSError as exc:
            raise ValueError(f"{f}: cannot read: {exc.strerror}") from None
        out += parse_documents(text, str(f))
    return out


# inotify(7): what a write, an atomic rename (editors, kubectl-like tools, the tests) or a removal
# of a watched file sends to its directory; IN_IGNORED: the directory's watch is gone
IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x8, 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
IN_ONLYDIR = 0x01000000
WATCH_MASK = IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_DELETE_SELF | IN_MOVE_SELF
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_EVENT = struct.Struct("=iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
_fallback_logged = False


class Inotify:
    """The directories of some paths watched with inotify; `wait` returns on an event, a timeout
    or `wake`. OSError from the constructor when inotify is unavailable."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            self._init1, self._add = libc.inotify_init1, libc.inotify_add_watch
        except AttributeError:
            raise OSError(errno.ENOSYS, "this C library has no inotify") from None
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = self._init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = fd
        try:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            os.close(fd)
            raise
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._lock = threading.Lock()  # `wake` (another thread) never writes to a closed descriptor
        self.watched: dict[int, Path] = {}  # watch descriptor -> directory
        self.complete = False  # every directory asked for has its watch
        self.lost = False  # a watched directory went away (or the queue overflowed): watch again

    def watch(self, dirs: set[Path]) -> None:
        """Watch each directory of `dirs` (again: the kernel keeps one watch per directory). One
        missing (or out of watches) leaves `complete` False: the caller polls until it is there."""
        self.lost, self.complete = False, True
        for d in dirs:
            wd = self._add(self.fd, os.fsencode(d), WATCH_MASK | IN_ONLYDIR)
            if wd >= 0:
                self.watched[wd] = d
            else:
                self.complete = False

    def wait(self, timeout: float) -> bool:
        """Block until an event, `wake` or `timeout`; drain the events; True when there were any."""
        try:
            ready = {fd for fd, _ in self._poll.poll(timeout * 1000)}
        except InterruptedError:
            return False
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 64)
            except BlockingIOError:
                pass
        if self.fd not in ready:
            return False
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return True
            at = 0
            while at + _EVENT.size <= len(buf):
                wd, mask, _cookie, size = _EVENT.unpack_from(buf, at)
                at += _EVENT.size + size
                if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_Q_OVERFLOW):
                    if mask & IN_IGNORED:
                        self.watched.pop(wd, None)
                    self.lost = True

    def wake(self) -> None:
        with self._lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:
                    pass  # already woken

    def close(self) -> None:
        with self._lock:
            for fd in (self.fd, self._wake_r, self._wake_w):
                os.close(fd)
            self.fd = self._wake_r = self._wake_w = -1


def watch_dirs(paths: list[str] | list[Path]) -> set[Path]:
    """The directories whose entries decide what `yaml_files(paths)` reads: a named directory itself,
    a file's directory; and where a path is a symbolic link (a Kubernetes ConfigMap mount swaps
    its `..data` link), also those of the target."""
    out: set[Path] = set()
    for p in map(Path, paths):
        for q in {p.absolute(), p.resolve()}:
            out.add(q if q.is_dir() else q.parent)
    return out


class FileSource:
    """Watches files: woken by inotify on their directories (a safety poll every `safety_poll` s
    besides), or by modification time every `interval` s where inotify is unavailable."""

    def __init__(self, paths: list[str], node: str | None = None, interval: float = 0.1,
                 safety_poll: float = 2.0):
        if not paths:
            raise ValueError("--from-file needs at least one path")
        self.paths = paths
        self.node = node
        self.interval = interval
        self.safety_poll = max(interval, safety_poll)
        self.watching = False  # True while run() waits on inotify (tests read it)
        self._stamps: dict[Path, tuple[float, int]] = {}
        self._docs: dict[Path, list[dict]] = {}
        self._errors: dict[Path, str] = {}
        self._generation = 0
        self._last: Snapshot | None = None
        self._errors_in_last: dict[Path, str] = {}
        self._stop = threading.Event()
        self._inotify: Inotify | None = None

    def load(self) -> tuple[Snapshot, bool]:
        """Re-read changed files; return the snapshot and whether anything changed."""
        changed = False
        files = yaml_files(self.paths)
        for gone in set(self._docs) - set(files):
            del self._docs[gone]
            self._stamps.pop(gone, None)
            changed = True
        for f in files:
            try:
                st = f.stat()
            except FileNotFoundError:
                self._stamps.pop(f, None)  # back with the same time and size (renamed back): read again
                if f in self._docs:
                    del self._docs[f]
                    changed = True
                self._errors[f] = f"{f}: file not found"
                continue
            stamp = (st.st_mtime, st.st_size)
            if self._stamps.get(f) == stamp:
                continue
            self._stamps[f] = stamp
            try:
                docs = parse_documents(f.read_text(), str(f))
                self._docs[f] = docs
                self._errors.pop(f, None)
                changed = True
            except (OSError, ValueError) as exc:
                msg = f"{f}: cannot load ({exc}); keeping its last good content"
                if self._errors.get(f) != msg:
                    log.error("%s", msg)
                self._errors[f] = msg
        if changed or self._last is None or self._errors != self._errors_in_last:
            if changed:
                self._generation += 1
            self._last = self.snapshot()  # built only when something changed: 10 polls a second stay cheap
            self._errors_in_last = dict(self._errors)
        return self._last, changed

    def snapshot(self) -> Snapshot:
        """The objects of every loaded file as a Snapshot (other nodes' pods left out). Namespaces'
        labels only when the files hold Namespace objects (else: unknown, every namespace resolves by
        its name alone, on the agent as on the controller)."""
        pods, classes, budgets, errors = [], [], [], list(self._errors.values())
        namespaces: dict[str, dict[str, str]] | None = None
        network_scopes, node_zone = None, None
        for f in sorted(self._docs):
            for doc in self._docs[f]:
                kind = doc.get("kind")
                if kind == "Pod":
                    try:
                        rec = PodRecord.from_object(doc)
                    except ValueError as exc:
                        errors.append(f"{f}: {exc}")
                        continue
                    if self.node and rec.node and rec.node != self.node:
                        continue  # another node's pod: the same files can drive several agents
                    pods.append(rec)
                elif kind == "EgressClass":
                    classes.append(doc)
                elif kind == "EgressBudget":
                    budgets.append(doc)
                elif kind == "Namespace":
                    name = (doc.get("metadata") or {}).get("name")
                    if not isinstance(name, str) or not name:
                        errors.append(f"{f}: Namespace without metadata.name")
                        continue
                    namespaces = namespaces if namespaces is not None else {}
                    namespaces[name] = namespace_labels(doc)
                elif kind == "NetworkScopes" and (doc.get("metadata") or {}).get("name") == SCOPES_NAME:
                    network_scopes = doc
                elif kind == "Node" and self.node and (doc.get("metadata") or {}).get("name") == self.node:
                    node_zone = node_zone_of(doc)
        return Snapshot(tuple(pods), tuple(classes), tuple(budgets), self._generation, tuple(errors),
                        namespaces=namespaces, network_scopes=network_scopes, node_zone=node_zone)

    def run(self, on_change: Callable[[Snapshot], None]) -> None:
        """Call `on_change` with the first snapshot, then with each changed one, until `stop`."""
        global _fallback_logged
        try:
            notify = Inotify()
        except OSError as exc:
            notify = None
            if not _fallback_logged:
                _fallback_logged = True
                log.warning("files: inotify unavailable (%s); polling modification times every %g s instead",
                            exc.strerror or exc, self.interval)
        if notify is None:
            return self._poll(on_change)
        try:
            notify.watch(watch_dirs(self.paths))  # before the first read: a change made meanwhile wakes the loop
            self._inotify, self.watching = notify, True
            snap, _ = self.load()
            on_change(snap)
            while not self._stop.is_set():
                # a directory without its watch (not there yet): poll as without inotify until it has one
                notify.wait(self.safety_poll if notify.complete else self.interval)
                if self._stop.is_set():
                    break
                if notify.lost or not notify.complete:
                    notify.watch(watch_dirs(self.paths))
                snap, changed = self.load()
                if changed:
                    on_change(snap)
        finally:
            self._inotify, self.watching = None, False
            notify.close()

    def _poll(self, on_change: Callable[[Snapshot], None]) -> None:
        snap, _ = self.load()
        on_change(snap)
        while not self._stop.wait(self.interval):
            snap, changed = self.load()
            if changed:
                on_change(snap)

    def stop(self) -> None:
        """End `run` now (it is woken)."""
        self._stop.set()
        notify = self._inotify
        if notify is not None:
            notify.wake()
