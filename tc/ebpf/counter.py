"""The internal counter: the pods' map and the node's, the programs that fill them, attached to the pod
devices and uplinks of one network namespace by tcx links or clsact filters (the package's docstring
says why and what is counted).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import struct
from collections.abc import Iterable, Iterator

from . import clsact, programs, tcx
from .clsact import Filters
from .maps import (KEY_SIZE, MAP_NAME, NODE_INTERNAL, NODE_INTERNET, NODE_MAP_NAME, NODE_MAP_SHAPE, NODE_PIN_NAME,
                   NODE_SCOPES_MAP_NAME, NODE_SCOPES_PIN_NAME, NODE_SCOPES_SHAPE, PIN_NAME, PROG_PIN,
                   SCOPE_BYTES_MAP_NAME, SCOPE_BYTES_PIN_NAME, SCOPE_ENTRIES, SCOPE_MAP_NAMES,
                   SCOPE_PIN_NAMES, SEGMENTS_MAP_NAME, SEGMENTS_PIN_NAME, address_of, adopt, bpffs_problem, create_map,
                   get_pinned, key_of, map_shape, pin_object, possible_cpus, scope_apply, scope_bytes_shape,
                   scope_entries, scope_map_shape, segments_shape, unpin_dir)
from .programs import Networks, parse_networks
from .syscall import (BPF_MAP_DELETE_ELEM, BPF_MAP_LOOKUP_BATCH, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_NOEXIST,
                      SYS_BPF, EbpfError, addr, bpf, bpf_attr, map_info, prog_info, refusal)

log = logging.getLogger(__name__)

ARPHRD_ETHER = 1
BATCH = 128  # entries a map read asks for at once


def unavailable(pin_dir: str) -> str | None:
    """None when the counter can run here, else the reason as a sentence. Loads the program the
    counter would load (against a one-entry map) and closes both: nothing is left behind."""
    if platform.machine() not in SYS_BPF:
        return f"bpf(2) has no syscall number known here ({platform.machine()!r}; known: {', '.join(SYS_BPF)})"
    fds: list[int] = []
    try:
        fds.append(create_map(map_shape(1)))
        nets: dict[int, tuple[str, ...]] = {4: ("10.0.0.0/8",), 6: ("fd00::/8",)}
        fds.append(programs.load(programs.program(nets, False, fds[0]), "na_probe"))
        fds.append(create_map(NODE_MAP_SHAPE, NODE_MAP_NAME))
        fds.append(programs.load(programs.program(nets, False, fds[2], node=True), "na_probe_node"))
        fds.append(create_map(segments_shape(1), SEGMENTS_MAP_NAME))  # gso_size: Linux >= 5.7
        fds.append(programs.load(programs.program(nets, True, fds[0], segments_fd=fds[4]), "na_probe_segs"))
    except OSError as exc:
        return refusal(exc)
    except EbpfError as exc:
        return str(exc)
    finally:
        for fd in fds:
            os.close(fd)
    return bpffs_problem(pin_dir)


class InternalCounter:
    """The pods' internal counters and the node's totals through its uplinks: pinned maps and the
    four programs that fill them, attached to the pod devices and the uplinks of one network
    namespace (None: this one).

    Attached with tcx links where the kernel has them (`attach_by` "tcx", Linux >= 6.6: a program runs
    straight from the device's hook, ~50 ns a packet), else as cls_bpf filters on a clsact qdisc ("tc":
    ~150 ns, the qdisc and classifier machinery; bench/forward_cost.py). The links are pinned in
    `pin_dir`, so they outlive the agent (fail-static) and a restarted agent adopts them; the programs
    are pinned too, so it can tell the ones it would load without opening a program by id (which
    needs CAP_SYS_ADMIN)."""

    def __init__(self, pin_dir: str, netns: str | None = None, pref: int = 0xC001, max_entries: int = 4096,
                 attach_by: str = "auto", gate_mark: int = 0, gate_pref: int = 0xC000):
        if attach_by not in ("auto", "tcx", "tc"):
            raise EbpfError(f"attach_by {attach_by!r}: choose auto, tcx or tc")
        if gate_mark and (gate_mark & (gate_mark - 1) or not 0 < gate_mark < 1 << 32):
            raise EbpfError(f"gate_mark {gate_mark:#x}: one bit of a 32-bit mark")
        self.pin_dir = pin_dir
        self.pin = os.path.join(pin_dir, PIN_NAME)
        self.node_pin = os.path.join(pin_dir, NODE_PIN_NAME)
        self.segments_pin = os.path.join(pin_dir, SEGMENTS_PIN_NAME)
        self.scope_bytes_pin = os.path.join(pin_dir, SCOPE_BYTES_PIN_NAME)
        self.node_scopes_pin = os.path.join(pin_dir, NODE_SCOPES_PIN_NAME)
        self.netns = netns
        self.pref = pref
        self.max_entries = max_entries
        self.cpus = possible_cpus()
        self.networks: Networks | None = None
        self.progs: dict[tuple[bool, bool, bool], tuple[int, int, bytes]] = {}  # PROGRAMS' keys -> (fd, id, tag)
        self._tc = Filters(netns, pref)
        self._batch: dict[int, tuple[ctypes.Array, ctypes.Array]] = {}  # u64s a value -> read buffers
        self.map_fd = self.node_map_fd = self.segments_fd = self.scope_bytes_fd = self.node_scopes_fd = -1
        self.scope_fds: dict[int, int] = {}  # family -> the scopes' LPM trie
        self._scope_entries: dict | None = None  # what the tries hold, once read
        problem = bpffs_problem(pin_dir)
        if problem:
            raise EbpfError(problem)
        os.makedirs(pin_dir, exist_ok=True)
        try:
            self.map_fd = adopt(self.pin, map_shape(max_entries), MAP_NAME)
            self.node_map_fd = adopt(self.node_pin, NODE_MAP_SHAPE, NODE_MAP_NAME)
            self.segments_fd = adopt(self.segments_pin, segments_shape(max_entries), SEGMENTS_MAP_NAME)
            self.scope_bytes_fd = adopt(self.scope_bytes_pin, scope_bytes_shape(max_entries), SCOPE_BYTES_MAP_NAME)
            self.node_scopes_fd = adopt(self.node_scopes_pin, NODE_SCOPES_SHAPE, NODE_SCOPES_MAP_NAME)
            for family, name in SCOPE_PIN_NAMES.items():
                self.scope_fds[family] = adopt(os.path.join(pin_dir, name), scope_map_shape(family, SCOPE_ENTRIES),
                                               SCOPE_MAP_NAMES[family])
        except BaseException:
            self.close()
            raise
        self.map_ids = {fd: map_info(fd)[1] for fd in (self.map_fd, self.node_map_fd, self.segments_fd,
                                                       self.scope_bytes_fd, self.node_scopes_fd,
                                                       *self.scope_fds.values())}
        self.attach_by = attach_by if attach_by != "auto" else "tcx" if tcx.tcx_available(netns) else "tc"
        # the egress links end the hook for an unmarked packet, sparing it the clsact filters after them (the
        # shaper's redirect at gate_pref), where nothing else would be skipped (attach() checks each device)
        self.gate_mark = gate_mark if self.attach_by == "tcx" else 0
        self.gate_pref = gate_pref
        self.gated: dict[str, str | None] = {}  # device -> None (its egress link gates) or why not, as last attached

    def close(self) -> None:
        """Close the map's and programs' descriptors; attached programs keep running (their filters
        hold them, and they hold the map)."""
        for fd, _, _ in self.progs.values():
            os.close(fd)
        self.progs = {}
        for fd in (self.map_fd, self.node_map_fd, self.segments_fd, self.scope_bytes_fd, self.node_scopes_fd,
                   *self.scope_fds.values()):
            if fd >= 0:
                os.close(fd)
        self.map_fd = self.node_map_fd = self.segments_fd = self.scope_bytes_fd = self.node_scopes_fd = -1
        self.scope_fds = {}
        self._tc.close()

    def __enter__(self) -> "InternalCounter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def unpin(self) -> None:
        """Remove the pinned maps (the programs attached keep them while they run) and the pin
        directory when nothing else is in it."""
        unpin_dir(self.pin_dir)

    # -- programs ---------------------------------------------------------------------------------
    def set_networks(self, networks: dict[int, tuple[str, ...]]) -> bool:
        """Load the four programs (pod device and uplink, ingress and egress) for these internal CIDRs
        (family -> CIDR texts) unless they are the ones loaded; True when (re)loaded. attach() then
        puts them on the devices."""
        nets = parse_networks(networks)
        if nets == self.networks and self.progs:
            return False
        texts = {family: tuple(map(str, n)) for family, n in nets.items()}
        loaded: dict[tuple[bool, bool, bool], tuple[int, int, bytes]] = {}
        try:
            for (uplink, egress, gated), name in programs.PROGRAMS.items():
                if gated and not self.gate_mark:
                    continue
                # a pod device's egress (what the pod receives) also counts the internet's merged segments
                segments = self.segments_fd if egress and not uplink else programs.NO_MAP
                # every program also counts its internal bytes by the far end's scope (the tries)
                scopes = {f: self.scope_fds[f] for f in nets}
                scope_bytes = self.node_scopes_fd if uplink else self.scope_bytes_fd
                code = programs.program(texts, egress, self.node_map_fd if uplink else self.map_fd, node=uplink,
                                        gate=self.gate_mark if gated else 0, segments_fd=segments,
                                        scopes_fds=scopes or None,
                                        scope_bytes_fd=scope_bytes if scopes else programs.NO_MAP)
                fd = programs.load(code, name)
                prog_id, tag, _ = prog_info(fd)
                uses = (self.node_map_fd if uplink else self.map_fd, *((segments,) if segments >= 0 else ()),
                        *((scope_bytes, *scopes.values()) if scopes else ()))
                pinned = self._pinned_program(name, tag, {self.map_ids[m] for m in uses})
                if pinned is not None:  # the same program, already running: keep it (its id is the filters')
                    os.close(fd)
                    fd, prog_id = pinned
                else:
                    pin_object(fd, os.path.join(self.pin_dir, PROG_PIN + name))
                loaded[(uplink, egress, gated)] = (fd, prog_id, tag)
        except BaseException:
            for fd, _, _ in loaded.values():
                os.close(fd)
            raise
        for fd, _, _ in self.progs.values():
            os.close(fd)
        self.progs, self.networks = loaded, nets
        return True

    def _pinned_program(self, name: str, tag: bytes, map_ids: set[int]) -> tuple[int, int] | None:
        """(fd, id) of the program pinned as `name` when it is the one with this tag using these maps."""
        pin = os.path.join(self.pin_dir, PROG_PIN + name)
        fd = get_pinned(pin)
        if fd is None:
            return None
        if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-prog":
            prog_id, found_tag, maps = prog_info(fd)
            if found_tag == tag and len(maps) == len(map_ids) and set(maps) == map_ids:
                return fd, prog_id
        os.close(fd)
        return None

    # -- the maps ---------------------------------------------------------------------------------
    def _entries(self, fd: int, words: int) -> Iterator[tuple[bytes, memoryview]]:
        """Every (key, per-CPU values as u64s) of a pod-keyed map with `words` u64s a value, BATCH at a
        time (BPF_MAP_LOOKUP_BATCH)."""
        buffers = self._batch.get(words)
        if buffers is None:
            buffers = self._batch[words] = ((ctypes.c_uint8 * (KEY_SIZE * BATCH))(),
                                            (ctypes.c_uint64 * (words * self.cpus * BATCH))())
        keys, values = buffers
        token_in, token_out = ctypes.c_uint32(0), ctypes.c_uint32(0)  # a hash map's batch token: a bucket
        first = True
        while True:
            attr = bpf_attr("=QQQQII", 0 if first else addr(token_in), addr(token_out), addr(keys), addr(values),
                         BATCH, fd)
            try:
                bpf(BPF_MAP_LOOKUP_BATCH, attr)
                done = False
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # ENOENT: the last batch (its entries are still given)
                    raise EbpfError(f"reading the internal-counter map failed: {exc.strerror}") from None
                done = True
            (count,) = struct.unpack_from("=I", attr, 32)
            raw_keys, raw_values = bytes(keys), memoryview(values).cast("B").cast("Q")
            per = words * self.cpus
            for i in range(count):
                yield raw_keys[i * KEY_SIZE:(i + 1) * KEY_SIZE], raw_values[i * per:(i + 1) * per]
            if done:
                return
            token_in.value, first = token_out.value, False

    def read(self) -> dict[str, tuple[int, int, int, int]]:
        """Pod address -> (bytes sent, packets sent, bytes received, packets received) by the pod,
        summed over the CPUs."""
        return {address_of(key): (sum(v[0::4]), sum(v[1::4]), sum(v[2::4]), sum(v[3::4]))
                for key, v in self._entries(self.map_fd, 4)}

    def read_segments(self) -> dict[str, tuple[int, int]]:
        """Pod address -> (bytes, segments) of what the pod received from the internet that the rules'
        count of it misses: the headers of the segments merged into its packets beyond each one's
        first, and how many such segments; summed over the CPUs."""
        return {address_of(key): (sum(v[0::2]), sum(v[1::2])) for key, v in self._entries(self.segments_fd, 2)}

    def read_scopes(self) -> dict[str, tuple[int, int, int, int]]:
        """Pod address -> (bytes sent cross-zone, sent cross-region, received cross-zone, received
        cross-region), summed over the CPUs: the part of read()'s internal bytes whose far end the tries
        place in another zone or region."""
        return {address_of(key): (sum(v[0::4]), sum(v[1::4]), sum(v[2::4]), sum(v[3::4]))
                for key, v in self._entries(self.scope_bytes_fd, 4)}

    def set_scopes(self, entries: dict) -> int:
        """Make the tries hold exactly these entries (network -> scope id, core.scopes.lpm_entries): only
        the difference is written, in place; the attached programs see it at their next packet. ->
        entries upserted or deleted."""
        if any(net.version not in self.scope_fds for net in entries):
            raise EbpfError("a scope entry of neither IPv4 nor IPv6")
        if self._scope_entries is None:  # what an earlier agent left in the pinned tries
            self._scope_entries = scope_entries(self.scope_fds)
        old = self._scope_entries
        upserts = {k: v for k, v in entries.items() if old.get(k) != v}
        deletes = [k for k in old if k not in entries]
        try:
            scope_apply(self.scope_fds, upserts, deletes)
        except OSError as exc:
            self._scope_entries = None  # read again next time: some of it may have been written
            raise EbpfError(f"updating the scopes tries failed: {exc.strerror}") from None
        self._scope_entries = dict(entries)
        return len(upserts) + len(deletes)

    def read_node(self) -> dict[str, int]:
        """The node's totals through its uplinks, summed over the CPUs, in bytes, by the rules' node
        kinds: egress_internal, ingress_internal, ingress_internet (its internet egress is the rules')."""
        internal = self._array_entry(self.node_map_fd, NODE_INTERNAL, "the node counter's map")
        internet = self._array_entry(self.node_map_fd, NODE_INTERNET, "the node counter's map")
        return {"egress_internal": internal[0], "ingress_internal": internal[2], "ingress_internet": internet[2]}

    def read_node_scopes(self) -> tuple[int, int, int, int]:
        """The node's (bytes sent cross-zone, sent cross-region, received cross-zone, received cross-region)
        through its uplinks, summed over the CPUs: the part of read_node()'s internal bytes whose far end the
        tries place in another zone or region (read_scopes' order)."""
        return self._array_entry(self.node_scopes_fd, 0, "the node's scope bytes")

    def _array_entry(self, fd: int, index: int, what: str) -> tuple[int, int, int, int]:
        """Entry `index` of a per-CPU array of four u64s (the node's maps), each word summed over the CPUs."""
        key = ctypes.c_uint32(index)
        values = (ctypes.c_uint64 * (4 * self.cpus))()
        try:
            bpf(BPF_MAP_LOOKUP_ELEM, bpf_attr("=IIQQ", fd, 0, addr(key), addr(values)))
        except OSError as exc:
            raise EbpfError(f"reading {what} failed: {exc.strerror}") from None
        return sum(values[0::4]), sum(values[1::4]), sum(values[2::4]), sum(values[3::4])

    def set_pods(self, addresses: Iterable[str]) -> int:
        """Make the maps' keys exactly these pods' addresses: a new pod starts at zero, a pod that
        stays keeps its counts. -> how many addresses were added or deleted (in either map)."""
        want = {key_of(a) for a in addresses}
        if len(want) > self.max_entries:
            raise EbpfError(f"{len(want)} pod addresses do not fit the internal counter's {self.max_entries} entries "
                            "(its max_entries); nothing was changed")
        changed: set[bytes] = set()
        for fd, words in ((self.map_fd, 4), (self.segments_fd, 2), (self.scope_bytes_fd, 4)):
            have = {key for key, _ in self._entries(fd, words)}
            self._set_keys(fd, have, want, words)
            changed |= have ^ want
        return len(changed)

    def _set_keys(self, fd: int, have: set[bytes], want: set[bytes], words: int) -> None:
        key_buf = ctypes.create_string_buffer(KEY_SIZE)
        zero = ctypes.create_string_buffer(8 * words * self.cpus)
        for key in have - want:  # first: room for the new ones
            key_buf.raw = key
            try:
                bpf(BPF_MAP_DELETE_ELEM, bpf_attr("=IIQ", fd, 0, addr(key_buf)))
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise EbpfError(f"deleting {address_of(key)} from the internal counter failed: "
                                    f"{exc.strerror}") from None
        for key in want - have:
            key_buf.raw = key
            try:
                bpf(BPF_MAP_UPDATE_ELEM, bpf_attr("=IIQQQ", fd, 0, addr(key_buf), addr(zero), BPF_NOEXIST))
            except OSError as exc:
                if exc.errno != errno.EEXIST:  # another counter on the same map added it meanwhile
                    raise EbpfError(f"adding {address_of(key)} to the internal counter failed: "
                                    f"{exc.strerror}") from None

    def attach(self, devices: Iterable[str], uplinks: Iterable[str] = ()) -> int:
        """On each listed pod device and uplink, on its ingress and egress, the current programs (the
        pods' or the node's): a pinned tcx link each (`attach_by` "tcx"; a link running another program
        is updated in place), or a clsact qdisc and our filter at our pref ("tc"; a filter running
        another program, or the other role's, is replaced). What the other way left on those devices
        goes. Devices not listed are left alone (a pod's device takes its filters when it goes; the
        link pins of devices that went are removed here). -> changes made.

        Another filter at our pref is not ours to replace, and an uplink that is not an Ethernet
        device would be misread: such devices are named in an EbpfError after the others were done."""
        if not self.progs:
            raise EbpfError("attach() before set_networks(): no counting program is loaded")
        tc = self._tc
        uplinks = tuple(dict.fromkeys(uplinks))
        try:
            self._ensure_pins()
            index = tc.indexes((*devices, *uplinks))
            taken: list[str] = []
            if uplinks:
                kinds = tc.chan.link_types()
                for dev in uplinks:
                    if dev in index and kinds.get(dev) != ARPHRD_ETHER:
                        taken.append(f"uplink {dev}: link type {kinds.get(dev)} is not Ethernet, and the program reads "
                                     "the addresses at Ethernet offsets (count by the rules here: --internal-counting rules)")
                        del index[dev]
            # what an agent that attached the other way left goes (a filter dump only where a clsact is)
            if self.attach_by == "tcx":
                done, self.gated = tcx.attach_links(tc, self.pin_dir, index, uplinks, self.progs, self.gate_mark,
                                                     self.gate_pref, self.gated)
                done += tc.detach(index)
            else:
                done = clsact.attach_filters(tc, index, uplinks, taken, self.progs)
                done += tcx.drop_links(self.pin_dir, index)
        except OSError as exc:
            raise EbpfError(f"attaching the counter in network namespace {self.netns!r}: {exc}") from exc
        if done:
            log.info("ebpf: %d change(s): %s", len(done), ", ".join(done[:8]) + (" ..." if len(done) > 8 else ""))
        if taken:
            raise EbpfError(f"the counter is not attached to {'; '.join(taken)}")
        return len(done)

    def _ensure_pins(self) -> None:
        """Pin the maps and programs again where their pins went (someone removed the directory): a restarted
        agent finds them, and the links have a directory to be pinned in."""
        os.makedirs(self.pin_dir, exist_ok=True)
        for fd, pin in ((self.map_fd, self.pin), (self.node_map_fd, self.node_pin), (self.segments_fd, self.segments_pin),
                        (self.scope_bytes_fd, self.scope_bytes_pin), (self.node_scopes_fd, self.node_scopes_pin),
                        *((fd, os.path.join(self.pin_dir, SCOPE_PIN_NAMES[f])) for f, fd in self.scope_fds.items()),
                        *((fd, os.path.join(self.pin_dir, PROG_PIN + programs.PROGRAMS[which])) for which, (fd, _, _)
                          in self.progs.items())):
            if not os.path.lexists(pin):
                pin_object(fd, pin)

    def detach(self, devices: Iterable[str]) -> list[str]:
        """Remove our links and our filters (our pref and our name) from these devices, and the clsact
        qdisc of a device we removed a filter from when no filter (anyone's) remains on it. -> what was
        removed."""
        removed = self._tc.detach(devices)
        try:
            removed += tcx.drop_links(self.pin_dir, self._tc.indexes(devices))
        except OSError as exc:
            raise EbpfError(f"detaching the counter in network namespace {self.netns!r}: {exc}") from exc
        return removed
