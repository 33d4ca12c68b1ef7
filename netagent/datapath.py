"""The kernel data path of one node: tc (the shaper) and iptables (the classifier).

`KernelDataPath` implements the agent's `DataPath` protocol. It applies a planned
`DesiredState` tc first, then iptables: a new pod's class exists before its CLASSIFY
rule steers packets to it. When a pod goes, its class is deleted a moment before its
rule; a packet that names a missing class lands in the default class, which is shaped
at a floor: never unshaped. Both appliers diff against the kernel, so an unchanged
state costs reads only and changes nothing.

The shaper and the classifier are used from three threads (sync loop, sampler,
HTTP scrapes); each has its own lock, and counters are read on a second netlink
socket so a scrape never waits for a reconcile's batch.

Counters cost: the HTB class stats are one netlink dump; the iptables/ipset byte counters are
read in-process (`iptables/nfnl.py`: the pod sets and, on nft, the node rules over netfilter
netlink, on legacy the rules through the xtables socket options; ~3 ms of CPU for 110 pods),
else with `ipset save` and two `iptables-save -c` (~20 ms, starting the processes). Both are kept with the
time they were read and shared: the sampler reads the class stats once a second and everyone
else takes that copy; the byte counters are read at most once per `max_age` (1 s by default;
the view asks for no fresher than a report period in controller mode, so the reporter's read
serves the scrapes), whatever the scrape rate. A read of the byte counters does not hold the
lock the sync loop applies under: it runs beside an apply and is redone under the lock only if
an apply ran meanwhile (the classifier's carried bytes and the kernel's sets must match).
"""
from __future__ import annotations

import ipaddress
import logging
import re
import threading
import time
from typing import Protocol

from core.direction import Direction
from core.errors import NetagentError
from iptables.apply import Classifier
from iptables.model import ClassifierState, PodClassification
from tc.ebpf import EbpfError, InternalCounter, remove_counting, unavailable, unpin_dir
from tc.errors import TcError
from tc.model import NODE_MINOR, ClassStats
from tc.netlink import Shaper
from tc.probe import Capabilities, probe, require

from .accounting import Carry
from .desired import DesiredState, DeviceCounting, from_wire, ip_bytes
from .options import COUNTING_MODES, DataPathOptions

log = logging.getLogger(__name__)

# Counters as the classifier reads them: per pod key {egress_internal, egress_internet,
# ingress_internal, ingress_internet} bytes, and the node's totals (same keys, plus
# egress_unknown_internet).
PodCounters = dict[str, dict[str, int]]
NodeCounters = dict[str, int]


class DataPath(Protocol):
    """The kernel seam of the agent. `KernelDataPath` is the real one; `netagent.datapath_fake`
    holds an in-memory one for fast tests of the agent's loop."""

    leaf_qdisc: str
    iptables_backend: str

    def apply(self, desired: DesiredState, full: bool = True) -> dict[str, int]:
        """Make the kernel match `desired`; the number of changes by kind ("tc", "iptables", "ipset")."""

    def class_stats(self, direction: Direction = Direction.UPLOAD) -> dict[int, ClassStats]:
        """HTB minor -> counters of the direction's shaper's pod classes (and its node and default
        classes; {} when the direction is not shaped); may be the sampler's copy, at most a second old."""

    def sample_stats(self, direction: Direction = Direction.UPLOAD) -> tuple[float, dict[int, ClassStats]]:
        """(monotonic time of the read, class stats) read now: the sampler's once-a-second read."""

    def counters(self, max_age: float = 0.0) -> tuple[PodCounters, NodeCounters]:
        """Bytes by direction and scope, per pod and for the node, read at most `max_age` s ago (the
        reporter reads fresh, once per report period; the view takes that read). The node's
        `egress_internet_wire` is its internet egress in IP bytes on the wire (docs/datapath.md)."""

    def adopted_rates(self, direction: Direction = Direction.UPLOAD) -> dict[int, tuple[int, int]]:
        """HTB minor -> (rate, ceil) bit/s the direction's shaper holds now: what a restarted agent keeps."""

    def pod_devices(self, uplinks: tuple[str, ...]) -> tuple[str, ...]:
        """The node's pod-facing devices (host-side veths, bridge ports included), less the uplinks:
        where downloads are redirected into the download shaper."""

    def load_carries(self) -> dict[tuple[str, str], tuple[int, int]] | None:
        """The accounting carries a previous agent kept ((direction, pod key) -> (bytes, packets));
        None: none were kept on this node (netagent.accounting)."""

    def save_carries(self, carries: dict[tuple[str, str], tuple[int, int]]) -> None:
        """Keep the accounting carries in the kernel for the next agent (all of them, replacing)."""


STATS_MAX_AGE = 1.5  # the sampler reads every second; a scrape takes its copy unless a sample was missed


def _copy(counters: tuple[PodCounters, NodeCounters]) -> tuple[PodCounters, NodeCounters]:
    pods, node = counters
    return {k: dict(v) for k, v in pods.items()}, dict(node)


class DataPathError(NetagentError, RuntimeError):
    """The node's kernel cannot carry netagent's data path as configured; the message says why and what to do."""


def probe_leaf_qdisc() -> tuple[str, Capabilities]:
    """Try the kernel once, in this process's network namespace (the node's): the best leaf
    qdisc it offers. The probe needs only CAP_NET_ADMIN, which the agent needs anyway; a
    probe that cannot run, or a kernel without what we need, is an error naming the fix."""
    try:
        caps = probe()
        require(caps)
    except TcError as exc:
        raise DataPathError(str(exc)) from exc
    log.info("tc probe: qdiscs %s; classifiers %s; actions %s; leaf qdisc %s", ",".join(sorted(caps.qdiscs)),
             ",".join(sorted(caps.classifiers)), ",".join(sorted(caps.actions)), caps.leaf_qdisc)
    return caps.leaf_qdisc, caps


def choose_internal_counting(mode: str, bpf_dir: str, services_known: bool) -> tuple[bool, str]:
    """Where the pods' internal bytes are counted: (on their devices?, why), for --internal-counting.

    On the devices (tc/ebpf/) internal packets cost no set lookup (docs/datapath.md). `auto` takes
    it when the kernel lets us load the program and pin its map, and the service CIDRs are known: a
    pod's packet to a ClusterIP crosses its device before kube-proxy's DNAT, so the device tells it
    internal only by the service range. `device` insists (a refusal stops the agent, with the
    reason); `rules` counts in ipsets as before."""
    if mode not in COUNTING_MODES:
        raise DataPathError(f"--internal-counting {mode!r}: choose one of {', '.join(COUNTING_MODES)}")
    if mode == "rules":
        return False, "by the rules (--internal-counting rules)"
    refused = unavailable(bpf_dir)
    if refused is not None:
        if mode == "device":
            raise DataPathError(f"--internal-counting device: {refused}")
        return False, f"by the rules: the device counter cannot run here ({refused})"
    if not services_known and mode == "auto":
        return False, ("by the rules: the service CIDRs are not known (give --service-cidr, chart value "
                       "serviceCIDRs), and a pod's packet to a ClusterIP crosses its device before DNAT")
    return True, f"on the pods' devices (eBPF, map pinned in {bpf_dir})"


# the device counter's scope bytes (tc/ebpf read_scopes), in its order: (the counts' direction, the scope)
SCOPE_KEYS = (("egress", "cross-zone"), ("egress", "cross-region"), ("ingress", "cross-zone"),
              ("ingress", "cross-region"))


def add_device_counts(pods: PodCounters, counted: dict[str, tuple[int, int, int, int]],
                      classified: tuple[PodClassification, ...],
                      segments: dict[str, tuple[int, int]] | None = None,
                      scopes: dict[str, tuple[int, int, int, int]] | None = None, described: bool = False) -> None:
    """Add the device counter's bytes (address -> egress bytes, packets, ingress bytes, packets) to the
    pods' internal counts, by the pod that holds each address. The rules count no internal byte while
    the devices do, and the sets keep what they counted before, so a switch to the devices carries the
    counts on. `segments` (address -> bytes, segments): what the rules' count of a pod's internet
    arrivals misses, the headers of the segments GRO merged (tc/ebpf, `read_segments`), added to it so
    that it is the bytes the uplink's wire carried; it only grows, so the sum never steps down. `scopes`
    (address -> sent cross-zone, sent cross-region, received cross-zone, received cross-region;
    `read_scopes`): the part of the internal bytes whose far end is in another zone or region, moved
    from `internal` to their own scopes (issue 39); shown while a description is in force (`described`)
    or once they are not zero, so that no scope's count ever steps down. Pure."""
    owner = {ip: p.key for p in classified for ip in p.ips}
    for ip, (egress, _, ingress, _) in counted.items():
        key = owner.get(ip)
        if key is None:
            continue  # an address the map still holds for a pod that went this moment
        c = pods.setdefault(key, {})
        c["egress_internal"] = c.get("egress_internal", 0) + egress
        c["ingress_internal"] = c.get("ingress_internal", 0) + ingress
    for ip, counts in (scopes or {}).items():
        key = owner.get(ip)
        if key is not None:
            move_scopes(pods.setdefault(key, {}), counts, described)
    for ip, (headers, _) in (segments or {}).items():
        key = owner.get(ip)
        if key is not None and headers:
            c = pods.setdefault(key, {})
            c["ingress_internet"] = c.get("ingress_internet", 0) + headers


def move_scopes(c: dict[str, int], counts: tuple[int, int, int, int], described: bool) -> None:
    """Move a pod's or the node's cross-zone and cross-region bytes (SCOPE_KEYS' order) out of its
    `<direction>_internal` count into their own, while a description is in force or once they are not
    zero (so no scope's count steps down); else leave `c` as without scopes. Pure."""
    if not described and not any(counts):
        return
    for (direction, scope), nbytes in zip(SCOPE_KEYS, counts):
        c[f"{direction}_internal"] = c.get(f"{direction}_internal", 0) - nbytes
        c[f"{direction}_{scope}"] = c.get(f"{direction}_{scope}", 0) + nbytes


# The accounting carries (netagent.accounting) live in the kernel beside the classes they complete, so
# the next agent goes on from them and a reboot (which takes the classes) takes them too: an ipset that
# no rule matches, one member a carry, its counters the carry, its comment "<direction> <pod key>".
CARRY_SET = "netagent-carry"
_CARRY_LINE = re.compile(r'^add \S+ \S+ packets (\d+) bytes (\d+) comment "(\S+) (\S+)"$')


def load_carries(runner) -> dict[tuple[str, str], tuple[int, int]] | None:
    proc = runner.run(["ipset", "save", CARRY_SET], check=False)
    if proc.returncode != 0:
        if "does not exist" in proc.stderr:
            return None
        raise DataPathError(f"ipset save {CARRY_SET} failed: {proc.stderr.strip()}")
    out = {}
    for line in proc.stdout.splitlines():
        m = _CARRY_LINE.match(line.strip())
        if m:
            out[(m.group(3), m.group(4))] = (int(m.group(2)), int(m.group(1)))
    return out


def save_carries(runner, carries: dict[tuple[str, str], tuple[int, int]]) -> None:
    """All carries at once: filled in a second set and swapped in (a reader sees the old or the new)."""
    tmp = f"{CARRY_SET}-tmp"
    spec = "hash:ip family inet counters comment maxelem 65536"
    lines = [f"create {CARRY_SET} {spec} -exist", f"create {tmp} {spec} -exist", f"flush {tmp}"]
    first = int(ipaddress.IPv4Address("127.0.0.1"))
    for i, ((direction, key), (nbytes, packets)) in enumerate(sorted(carries.items())):
        comment = f"{direction} {key}"
        if len(comment) > 255 or '"' in comment or " " in key:
            continue  # a pod key no comment can hold: its carry stays in this process only
        lines.append(f'add {tmp} {ipaddress.IPv4Address(first + i)} packets {packets} bytes {nbytes} comment "{comment}"')
    lines += [f"swap {tmp} {CARRY_SET}", f"destroy {tmp}"]
    runner.run(["ipset", "restore"], stdin="\n".join(lines) + "\n")


def remove_carries(runner) -> list[str]:
    """Cleanup: the carries' sets, where they exist."""
    removed = []
    for name in (CARRY_SET, f"{CARRY_SET}-tmp"):
        if runner.run(["ipset", "destroy", name], check=False).returncode == 0:
            removed.append(f"ipset {name}")
    return removed


class KernelDataPath:
    def __init__(self, options: DataPathOptions, iptables_backend: str = "auto", netns: str | None = None):
        self.options = options
        self.leaf_qdisc = options.leaf_qdisc
        self._shaper = Shaper(netns)
        self._stats_shaper = Shaper(netns)
        try:
            self._classifier = Classifier(backend=iptables_backend, netns=netns)
        except Exception as exc:
            raise DataPathError(f"iptables: {exc}") from exc
        self._netns = netns
        self._counter: InternalCounter | None = None
        if options.internal_by_device:
            try:
                self._counter = InternalCounter(options.bpf_dir, netns=netns, pref=options.count_pref,
                                                attach_by=options.count_attach,
                                                gate_mark=options.mark_bit if options.count_gate else 0,
                                                gate_pref=options.filter_pref)
                log.info("the device counter attaches its programs by %s", "tcx links" if
                         self._counter.attach_by == "tcx" else f"tc filters at pref {options.count_pref:#x}")
            except (EbpfError, OSError) as exc:
                self._classifier.close()
                raise DataPathError(f"the device counter of internal bytes: {exc}") from exc
        self._counting_cleared = False  # rules mode: a device counter left by an earlier run removed
        self._counted_pods: tuple[PodClassification, ...] = ()  # whose addresses the device counter holds
        self._scoped = False  # a NetworkScopes description is in the counter's tries
        self._applied_counting: DeviceCounting | None = None  # what the counter was last made to match
        # the counter's map is read (scrapes, reports) beside an apply that changes its entries: one at a
        # time (its reads share one batch buffer), never waiting for the tc lock
        self._counter_lock = threading.Lock()
        self.iptables_backend = self._classifier.backend
        self._tc_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._ipt_lock = threading.Lock()
        self._counters_lock = threading.Lock()  # one counters read at a time; the others take its result
        self._ipt_seq = 0  # odd while an iptables apply runs; bumped at its start and end
        self._applied_classifier: ClassifierState | None = None  # the state the kernel was last made to match
        self._hooks: tuple[int, ...] | None = None  # our mangle lines per family the last apply made (from its rules)
        self._hooks_read: tuple[object, tuple[int, ...]] | None = None  # (rules version, the lines then)
        self._stats: dict[Direction, tuple[float, dict[int, ClassStats]]] = {}  # per direction: (read at, stats)
        self._counters: tuple[float, tuple[PodCounters, NodeCounters]] | None = None
        # per direction the host traffic bypassing its shaper: (carried from earlier pod sets, the pod set now,
        # its first count, the most counted over it since)
        self._bypass: dict[str, tuple[int, frozenset | None, int, int]] = {d: (0, None, 0, 0) for d in ("egress", "ingress")}
        self._shaped = {"egress": Carry(), "ingress": Carry()}  # the node classes' IP bytes, read under _counters_lock
        self.reads = {"class_stats": 0, "counters": 0}  # kernel reads done (bench/agent.py, tests)

    def check_conflicts(self) -> None:
        """Refuse to start when someone else already uses our mark bit."""
        try:
            with self._ipt_lock:
                self._classifier.check_conflicts(self.options.mark_bit)
        except Exception as exc:
            raise DataPathError(f"firewall mark bit {self.options.mark_bit:#x}: {exc} (choose another with --mark-bit)") from exc

    def apply(self, desired: DesiredState, full: bool = True) -> dict[str, int]:
        """tc first, then iptables. Returns the number of changes by kind (tc, iptables, ipset); all 0: in sync.

        tc is always diffed against the kernel (a netlink dump: about a millisecond). iptables is
        read back only when `full` or when its desired state changed: reading it costs two
        iptables-save runs, and a rate change, the common case, leaves it as it was."""
        with self._tc_lock:
            # every shaper's classes exist before iptables marks a packet for them
            tc_changes = sum(self._shaper.apply(spec).changes for _, spec in desired.shapers.items() if spec is not None)
            # the devices count internal bytes before the rules stop counting them
            with self._counter_lock:
                ebpf_changes = self._apply_counting(desired.device_counting, full, desired.classifier.uplinks)
                self._counted_pods = desired.classifier.pods if desired.device_counting else ()
        changes = {"tc": tc_changes, "ebpf": ebpf_changes}
        with self._ipt_lock:
            if full or desired.classifier != self._applied_classifier:
                self._applied_classifier = None  # unknown until this apply succeeds
                self._hooks = None
                self._ipt_seq += 1
                try:
                    changes.update({k: int(v) for k, v in self._classifier.apply(desired.classifier).items()})
                finally:
                    self._ipt_seq += 1
                self._applied_classifier = desired.classifier
                self._hooks = self._classifier.expected_lines(desired.classifier)
        for d, spec in desired.shapers.items():
            if spec is None:
                with self._tc_lock:  # this direction's shaping turned off: nothing marks for it any more
                    changes["tc"] += len(self._remove_shaper(d))
        return changes

    def _apply_counting(self, counting: DeviceCounting | None, full: bool, uplinks: tuple[str, ...]) -> int:
        """The device counter as `counting` says: its programs, its map's addresses, its filters on the pod
        devices and the uplinks. Re-read from the kernel when `full` or when it changed (a new pod or pod device), as the
        rules are: checking 110 devices' filters is two dumps each (~15 ms)."""
        if counting is not None and not full and counting == self._applied_counting:
            return 0
        self._applied_counting = None  # unknown until this apply succeeds
        if counting is None:
            if self._counter is not None or self._counting_cleared:
                return 0
            # counting by the rules: a counter an earlier run in device mode left on the pods' devices and the
            # uplinks would count beside the sets and rules; it goes, once: its filters, and its pins (its
            # links' programs are detached when they are released)
            removed = remove_counting((*self._shaper.devices_of_kind(("veth",)), *uplinks), self.options.count_pref,
                                      self._netns)
            removed += unpin_dir(self.options.bpf_dir)
            self._counting_cleared = True
            return len(removed)
        if self._counter is None:
            raise DataPathError("internal bytes are to be counted on the devices, but this data path was started "
                                "without the device counter")
        try:
            # loading the programs is no kernel change in itself (a new process always loads them); the
            # filters that run them are, and attach() replaces those that run other programs
            self._counter.set_networks(dict(counting.networks))
            changes = self._counter.set_pods(counting.addresses)
            # the tries change in place: the programs attached see the new scopes at their next packet
            changes += self._counter.set_scopes({ipaddress.ip_network(c): sid for c, sid in counting.scopes})
            self._scoped = bool(counting.scopes)
        except EbpfError as exc:
            raise DataPathError(f"the device counter of internal bytes: {exc}") from exc
        try:
            changes += self._counter.attach(counting.devices, counting.uplinks)
        except EbpfError as exc:
            # one device that refuses (another filter at our priority) must not hold back every pod's
            # rules: the others are done, and the next sync tries again
            log.warning("the device counter of internal bytes: %s; what passes there is not counted", exc)
            return changes
        self._applied_counting = counting
        return changes

    def _remove_shaper(self, direction: Direction) -> list[str]:
        o = self.options
        ifb = o.ifbs[direction]
        if not self._shaper.has_device(ifb):
            return []
        return self._shaper.cleanup(ifb, self._shaper.devices_of_kind(exclude=(ifb,)), o.filter_pref)

    def pod_devices(self, uplinks: tuple[str, ...]) -> tuple[str, ...]:
        with self._tc_lock:
            return self._shaper.devices_of_kind(("veth",), exclude=tuple(uplinks))

    def _read_hooks(self) -> tuple[int, ...]:
        """Lines of our chains and hooks in the mangle table, per family: a cheap fingerprint (one
        iptables-save each, which takes no xtables lock) that any flush or deletion changes. Read
        again only when the rules' version (read in-process, before the lines) moved: the drift
        watch asks every second, and on a quiet node no process is started for it."""
        version = self._classifier.rules_version()
        if version is not None and self._hooks_read is not None and self._hooks_read[0] == version:
            return self._hooks_read[1]
        prefix, runner = self._classifier.prefix, self._classifier.runner
        lines = tuple(sum(prefix in line for line in runner.save(family, self.iptables_backend, "mangle").splitlines())
                      for family in (4, 6))
        self._hooks_read = None if version is None else (version, lines)
        return lines

    def hooks_fingerprint(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(what the last apply left, what the kernel has now), or None while an apply runs or before
        the first: the drift watch never waits for the sync loop."""
        if self._hooks is None or not self._ipt_lock.acquire(blocking=False):
            return None
        try:
            return self._hooks, self._read_hooks()
        finally:
            self._ipt_lock.release()

    def sample_stats(self, direction: Direction = Direction.UPLOAD) -> tuple[float, dict[int, ClassStats]]:
        o = self.options
        with self._stats_lock:
            stats = self._stats_shaper.stats(o.ifbs[direction], o.htb_majors[direction])
            if direction is Direction.UPLOAD:
                self.reads["class_stats"] += 1
            self._stats[direction] = (time.monotonic(), stats)
            return self._stats[direction]

    def class_stats(self, direction: Direction = Direction.UPLOAD) -> dict[int, ClassStats]:
        cached = self._stats.get(direction)
        if cached is not None and time.monotonic() - cached[0] <= STATS_MAX_AGE:
            return cached[1]
        return self.sample_stats(direction)[1]

    def counters(self, max_age: float = 0.0) -> tuple[PodCounters, NodeCounters]:
        with self._counters_lock:
            cached = self._counters
            if cached is not None and time.monotonic() - cached[0] <= max_age:
                return _copy(cached[1])
            seq = self._ipt_seq
            found = None
            if seq % 2 == 0:
                t = time.monotonic()
                found = self._classifier.counters()
                if self._ipt_seq != seq:
                    found = None  # an apply ran meanwhile: the carried bytes may not match the sets read
            if found is None:
                with self._ipt_lock:
                    t = time.monotonic()
                    found = self._classifier.counters()
            if self._counter is not None:
                with self._counter_lock:
                    add_device_counts(found[0], self._counter.read(), self._counted_pods,
                                      self._counter.read_segments(), self._counter.read_scopes(), self._scoped)
                    for kind, nbytes in self._counter.read_node().items():
                        found[1][kind] = found[1].get(kind, 0) + nbytes
                    # the uplinks' cross bytes, out of the node's internal totals as the pods' are
                    move_scopes(found[1], self._counter.read_node_scopes(), self._scoped)
            self.reads["counters"] += 1
            found[1]["egress_internet_wire"] = self._wire("egress", self.sample_stats()[1].get(NODE_MINOR), *found)
            found[1]["ingress_internet_wire"] = self._wire("ingress", self.sample_stats(Direction.DOWNLOAD)[1].get(
                NODE_MINOR), *found)
            self._counters = (t, found)
            return _copy(found)

    def _wire(self, direction: str, node_class: ClassStats | None, pods: PodCounters, node: NodeCounters) -> int:
        """The node's internet traffic in `direction` ("egress", "ingress") in IP bytes on the wire:
        what its shaper let through (the node class, per segment, after its drops) plus the traffic
        that bypasses it (host and hostNetwork pods).

        The iptables counters cannot say it alone: they count before the shaper (bytes it then drops
        and TCP sends again count twice) and a GSO packet once with one header (bulk TCP undercounts
        by ~3.5 %). The unshaped part is the node's iptables count minus what the pod sets and the
        unknown-pod rule counted (the same units); it is counted from the first read with the same pods,
        so a pod that goes (its bytes leave the sum) is not mistaken for host traffic."""
        # the node class counts from zero when made again (the IFB replaced): carried, never backwards
        shaped = self._shaped[direction].read(
            ip_bytes(node_class.bytes, node_class.packets, self.options) if node_class else 0)
        rest = node.get(f"{direction}_internet", 0) - node.get(f"{direction}_unknown_internet", 0) - sum(
            c.get(f"{direction}_internet", 0) for c in pods.values())
        # `rest` is a difference of counters read one after the other (never above the truth: the node's are read
        # first) and may dip; the bypass only grows, so the most it reached is kept (summing its rises also kept
        # each dip's way back up: +3 % in a flood, tests/test_agent_accounting_traffic.py)
        keys = frozenset(pods)
        carried, held, first, most = self._bypass[direction]
        if held == keys:
            most = max(most, rest - first)
        else:
            carried, first, most = carried + most, rest, 0
        self._bypass[direction] = (carried, keys, first, most)
        return shaped + carried + most

    def adopted_rates(self, direction: Direction = Direction.UPLOAD) -> dict[int, tuple[int, int]]:
        """minor -> (rate, ceil) in IP bit/s of every HTB class the direction's shaper holds now (the
        node class included, as minor 1): a restarted agent starts from exactly these."""
        o = self.options
        return {minor: (from_wire(st.rate_bytes * 8, o), from_wire(st.ceil_bytes * 8, o))
                for minor, st in self.sample_stats(direction)[1].items()}

    def load_carries(self) -> dict[tuple[str, str], tuple[int, int]] | None:
        return load_carries(self._classifier.runner)

    def save_carries(self, carries: dict[tuple[str, str], tuple[int, int]]) -> None:
        save_carries(self._classifier.runner, carries)

    def close(self) -> None:
        for s in (self._shaper, self._stats_shaper):
            s.close()
        self._classifier.close()
        if self._counter is not None:
            self._counter.close()  # the filters and the pinned map stay: fail-static, adopted at the next start
