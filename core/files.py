"""`--from-file`: Pods, EgressClasses and EgressBudgets from YAML, reloaded when they change.

This is how one machine with no cluster runs netagent (and how the demo runs). Files
hold objects in exactly their Kubernetes form, several per file (`---`). A file that
fails to parse keeps its last good content: a typo while editing never drops pods.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

import yaml

from .objects import PodRecord, Snapshot

log = logging.getLogger(__name__)
KINDS = {"Pod", "EgressClass", "EgressBudget"}
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


class FileSource:
    """Watches files by modification time (cheap: a stat per file per tick)."""

    def __init__(self, paths: list[str], node: str | None = None, interval: float = 0.1):
        if not paths:
            raise ValueError("--from-file needs at least one path")
        self.paths = paths
        self.node = node
        self.interval = interval
        self._stamps: dict[Path, tuple[float, int]] = {}
        self._docs: dict[Path, list[dict]] = {}
        self._errors: dict[Path, str] = {}
        self._generation = 0
        self._last: Snapshot | None = None
        self._errors_in_last: dict[Path, str] = {}
        self._stop = threading.Event()

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
        """The objects of every loaded file as a Snapshot (other nodes' pods left out)."""
        pods, classes, budgets, errors = [], [], [], list(self._errors.values())
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
        return Snapshot(tuple(pods), tuple(classes), tuple(budgets), self._generation, tuple(errors))

    def run(self, on_change: Callable[[Snapshot], None]) -> None:
        """Call `on_change` with the first snapshot, then with each changed one, until `stop`."""
        snap, _ = self.load()
        on_change(snap)
        while not self._stop.wait(self.interval):
            snap, changed = self.load()
            if changed:
                on_change(snap)

    def stop(self) -> None:
        """End `run` at its next tick."""
        self._stop.set()
