"""Reading netfilter state in-process: ipset sets and nftables rules over netfilter netlink, and
the legacy backend's rules through the xtables socket options (what iptables-legacy-save reads).

`Classifier.counters()` runs every few seconds. By exec'ing `ipset save` and two
`iptables-save -c` it cost ~20-30 ms of CPU for 110 pods, most of it starting the three
processes. Here the same counters are one NETLINK_NETFILTER socket, opened once in the
node's (or a test's) network namespace, and a few dumps read with `struct`, decoding only
what is needed: per member of a pod set its address, byte counter and comment; per rule of
our nftables chains its counter and comment. On the legacy backend the rules come from
IPT_SO_GET_ENTRIES on a raw socket of each family (the kernel's rule blob, one copy).
pyroute2's own decoder is not used: it decodes every attribute of every member and took
~40 ms for the same 880 members. The same socket reads an apply's view of our sets
(`read_set`) and the rules' version for the drift watch (`generation`, `digest`).

What cannot be read here raises `NetlinkUnavailable`, and the classifier goes back to the
tools for good (no netfilter netlink in a sandbox, the ipset protocol refused, a socket that
fails). A set or table that does not exist reads as None / nothing.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import ipaddress
import os
import socket
import struct
import threading

import nlwire
from iptables.errors import IptablesError
from nlwire import NLA_TYPE_MASK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR

NETLINK_NETFILTER = 12

NFNL_SUBSYS_IPSET, NFNL_SUBSYS_NFTABLES = 6, 10
IPSET_CMD_LIST = 7
IPSET_PROTOCOL_MIN = 6  # every kernel with ipset in netlink speaks 6; 7 only adds header attributes
IPSET_ERR_PROTOCOL = 4097
IPSET_ATTR_PROTOCOL, IPSET_ATTR_SETNAME, IPSET_ATTR_TYPENAME, IPSET_ATTR_FAMILY, IPSET_ATTR_ADT = 1, 2, 3, 5, 8
IPSET_ATTR_DATA, IPSET_ATTR_IP, IPSET_ATTR_BYTES, IPSET_ATTR_COMMENT = 7, 1, 24, 26
IPSET_ATTR_CIDR, IPSET_ATTR_CADT_FLAGS, IPSET_ATTR_SKBMARK, IPSET_ATTR_SKBPRIO = 3, 8, 27, 28
IPSET_FLAG_NOMATCH = 1 << 2
# a set's CADT_FLAGS -> its create options, in the order `ipset save` prints them
IPSET_SET_EXTENSIONS = ((1 << 3, "counters"), (1 << 4, "comment"), (1 << 6, "skbinfo"))
IPSET_ATTR_IPADDR_IPV4, IPSET_ATTR_IPADDR_IPV6 = 1, 2

NFT_MSG_GETRULE, NFT_MSG_GETGEN = 7, 16
NFTA_GEN_ID = 1
NFTA_RULE_TABLE, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS, NFTA_RULE_USERDATA = 1, 2, 4, 7
NFTA_LIST_ELEM, NFTA_EXPR_NAME, NFTA_EXPR_DATA = 1, 1, 2
NFTA_COUNTER_BYTES = 1
NFTA_MATCH_NAME, NFTA_MATCH_INFO = 1, 3
NFTNL_UDATA_RULE_COMMENT = 0
NFPROTO = {4: socket.AF_INET, 6: socket.AF_INET6}  # NFPROTO_IPV4 = 2, NFPROTO_IPV6 = 10

_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big-endian, unused here)
_BE64 = struct.Struct(">Q")
# errors that mean "this kernel (or sandbox) will not answer over netlink": use the tools
_UNAVAILABLE = (errno.EPERM, errno.EACCES, errno.EOPNOTSUPP, errno.EPROTONOSUPPORT, errno.EAFNOSUPPORT,
                errno.EINVAL, IPSET_ERR_PROTOCOL)
TIMEOUT = 10.0
RECV_BYTES = 64 << 10  # a dump datagram is at most 32 KiB (the kernel's netlink_dump)


class NetlinkUnavailable(IptablesError):
    """Netfilter netlink cannot be used here: read the counters with the tools instead."""


class NetfilterReader:
    """One NETLINK_NETFILTER socket in a network namespace (None: this process's)."""

    def __init__(self, netns: str | None = None):
        try:
            self.sock = nlwire.socket_in(netns, NETLINK_NETFILTER)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            self.sock.settimeout(TIMEOUT)
            self.sock.bind((0, 0))
        except OSError as exc:
            raise NetlinkUnavailable(f"cannot open netfilter netlink in network namespace {netns!r}: {exc}") from exc
        self.netns = netns
        self.seq = 0
        self._lock = threading.Lock()  # one request at a time: the counters and the drift watch share the socket
        self._addresses: dict[bytes, str] = {}  # packed -> canonical text: pod addresses repeat every read
        self._comments: dict[bytes, str] = {}  # ... and so do their comments

    def close(self) -> None:
        self.sock.close()

    def _dump(self, msg_type: int, family: int, attrs: bytes, what: str, dump: bool = True) -> list[memoryview] | None:
        """One NLM_F_DUMP request; -> the attributes (after nfgenmsg) of every answer, or None when
        the object asked for does not exist (ENOENT). Not `dump`: a plain request, one answer."""
        with self._lock:
            return self._exchange(msg_type, family, attrs, what, dump)

    def _exchange(self, msg_type: int, family: int, attrs: bytes, what: str, dump: bool) -> list[memoryview] | None:
        self.seq = (self.seq + 1) & 0x7FFFFFFF or 1
        seq = self.seq
        body = _NFGEN.pack(family, 0, 0) + attrs
        flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else 0)
        try:
            self.sock.send(nlwire.message(msg_type, flags, seq, body))
            out: list[memoryview] = []
            while True:
                for mtype, _flags, mseq, payload in nlwire.messages(memoryview(self.sock.recv(RECV_BYTES))):
                    if mseq != seq:
                        continue
                    if mtype == NLMSG_DONE:
                        return out
                    if mtype == NLMSG_ERROR:
                        (err,) = struct.unpack_from("=i", payload, 0)
                        if err == 0:
                            return out
                        if -err == errno.ENOENT:
                            return None
                        if -err in _UNAVAILABLE:
                            raise NetlinkUnavailable(f"{what} over netlink refused: {os.strerror(-err) if -err < 4096 else -err}")
                        raise IptablesError(f"{what} over netlink failed: {os.strerror(-err)}")
                    out.append(payload[_NFGEN.size:])
                    if not dump:
                        return out
        except OSError as exc:  # a timeout included: the caller may fall back to the tools
            raise NetlinkUnavailable(f"{what} over netlink failed: {exc}") from exc

    # -- ipset -----------------------------------------------------------------------------
    def _list_set(self, name: str) -> list[memoryview] | None:
        """IPSET_CMD_LIST of one set: its answer messages, None when it does not exist."""
        request = nlwire.attr(IPSET_ATTR_PROTOCOL, bytes([IPSET_PROTOCOL_MIN])) + nlwire.attr(IPSET_ATTR_SETNAME, name.encode() + b"\0")
        return self._dump((NFNL_SUBSYS_IPSET << 8) | IPSET_CMD_LIST, socket.AF_INET, request, f"ipset list {name}")

    def set_members(self, name: str) -> dict[str, tuple[int, str | None]] | None:
        """Members of one hash:ip set with the counters extension: canonical address -> (bytes,
        comment). None when the set does not exist."""
        answers = self._list_set(name)
        if answers is None:
            return None
        out: dict[str, tuple[int, str | None]] = {}
        names, comments = self._addresses, self._comments
        if len(names) + len(comments) > 1 << 16:
            names.clear()
            comments.clear()
        unpack, be64 = nlwire.NLA.unpack_from, _BE64.unpack_from
        for msg in answers:
            for kind, adt in nlwire.iter_attrs(msg):
                if kind != IPSET_ATTR_ADT:
                    continue
                # the hot loop (one pass per member): offsets, no generators
                off, end = 0, len(adt)
                while off + 4 <= end:
                    elen, dkind = unpack(adt, off)
                    if elen < 4:
                        break
                    eoff, eend = off + 4, off + elen
                    off += (elen + 3) & ~3
                    if dkind & NLA_TYPE_MASK != IPSET_ATTR_DATA:
                        continue
                    member, nbytes, comment = None, 0, None
                    while eoff + 4 <= eend:
                        alen, akind = unpack(adt, eoff)
                        if alen < 4:
                            break
                        akind &= NLA_TYPE_MASK
                        if akind == IPSET_ATTR_IP:  # nested: one IPADDR_IPV4 or _IPV6
                            raw = bytes(adt[eoff + 8:eoff + 4 + unpack(adt, eoff + 4)[0]])
                            member = names.get(raw)
                            if member is None:
                                member = names[raw] = str(ipaddress.ip_address(raw))
                        elif akind == IPSET_ATTR_BYTES:
                            nbytes = be64(adt, eoff + 4)[0]
                        elif akind == IPSET_ATTR_COMMENT:
                            raw = bytes(adt[eoff + 4:eoff + alen])
                            comment = comments.get(raw)
                            if comment is None:
                                comment = comments[raw] = nlwire.text(raw)
                        eoff += (alen + 3) & ~3
                    if member is not None:
                        out[member] = (nbytes, comment)
        return out

    def read_set(self, name: str) -> tuple[str, int, tuple[str, ...], dict[str, tuple[tuple[tuple[str, str], ...], int]]] | None:
        """One whole set as `ipset save` shows it: (type, family 4/6, extensions, canonical member ->
        ((option, value) in `parse_ipset_entries`' order and spelling, bytes)). None: no such set."""
        answers = self._list_set(name)
        if answers is None:
            return None
        kind, family, extensions = "", 0, ()
        members: dict[str, tuple[tuple[tuple[str, str], ...], int]] = {}
        for msg in answers:
            for akind, value in nlwire.iter_attrs(msg):
                if akind == IPSET_ATTR_TYPENAME:
                    kind = nlwire.text(value)
                elif akind == IPSET_ATTR_FAMILY:
                    family = {socket.AF_INET: 4, socket.AF_INET6: 6}.get(value[0], 0)
                elif akind == IPSET_ATTR_DATA:
                    for hkind, hvalue in nlwire.iter_attrs(value):
                        if hkind == IPSET_ATTR_CADT_FLAGS:
                            flags = struct.unpack_from(">I", hvalue, 0)[0]
                            extensions = tuple(opt for bit, opt in IPSET_SET_EXTENSIONS if flags & bit)
                elif akind == IPSET_ATTR_ADT:
                    for dkind, entry in nlwire.iter_attrs(value):
                        if dkind == IPSET_ATTR_DATA:
                            found = self._member(entry)
                            if found is not None:
                                members[found[0]] = found[1:]
        return kind, family, extensions, members

    def _member(self, entry: bytes | memoryview) -> tuple[str, tuple[tuple[str, str], ...], int] | None:
        """(canonical member, extensions, bytes) of one IPSET_ATTR_DATA entry of a hash:ip or hash:net set."""
        raw, cidr, nbytes = None, b"", 0
        ext: dict[str, str] = {}
        for kind, value in nlwire.iter_attrs(entry):
            if kind == IPSET_ATTR_IP:
                raw = bytes(value[4:nlwire.NLA.unpack_from(value, 0)[0]])  # the one nested IPADDR_IPV4/_IPV6
            elif kind == IPSET_ATTR_CIDR:
                cidr = bytes(value[:1])
            elif kind == IPSET_ATTR_CADT_FLAGS:
                if struct.unpack_from(">I", value, 0)[0] & IPSET_FLAG_NOMATCH:
                    ext["nomatch"] = ""
            elif kind == IPSET_ATTR_BYTES:
                nbytes = _BE64.unpack_from(value, 0)[0]
            elif kind == IPSET_ATTR_COMMENT:
                ext["comment"] = nlwire.text(value)
            elif kind == IPSET_ATTR_SKBMARK:
                mark, mask = struct.unpack_from(">II", value, 0)
                ext["skbmark"] = f"0x{mark:x}/0x{mask:x}"
            elif kind == IPSET_ATTR_SKBPRIO:
                prio = struct.unpack_from(">I", value, 0)[0]
                ext["skbprio"] = f"{prio >> 16:x}:{prio & 0xFFFF:x}"
        if raw is None:
            return None
        key = raw + b"/" + cidr
        member = self._addresses.get(key)
        if member is None:
            addr = ipaddress.ip_address(raw)
            member = self._addresses[key] = str(addr) if not cidr else str(ipaddress.ip_network(f"{addr}/{cidr[0]}", strict=False))
        return member, tuple((k, ext[k]) for k in ("nomatch", "comment", "skbmark", "skbprio") if k in ext), nbytes

    # -- nftables --------------------------------------------------------------------------
    def generation(self) -> int:
        """The namespace's nftables generation: every commit of any table by any program bumps it."""
        answers = self._dump((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN, socket.AF_UNSPEC, b"", "nftables generation",
                             dump=False)
        for kind, value in nlwire.iter_attrs(answers[0] if answers else b""):
            if kind == NFTA_GEN_ID:
                return struct.unpack_from(">I", value, 0)[0]
        raise NetlinkUnavailable("the nftables generation was not in the answer")

    def rule_counters(self, family: int, table: str, prefix: str) -> list[tuple[str, str, int]]:
        """(chain, comment, bytes) of every commented rule in `prefix`-chains of an nftables table
        made by iptables-nft (family 4: ip, 6: ip6), in the kernel's order: what `counted_comments`
        finds in `iptables-nft-save -c -t <table>`. No such table: []."""
        request = nlwire.attr(NFTA_RULE_TABLE, table.encode() + b"\0")
        answers = self._dump((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETRULE, NFPROTO[family], request,
                             f"nftables rules of {table}")
        out: list[tuple[str, str, int]] = []
        head = (prefix + "-").encode()
        for msg in answers or ():
            chain = comment = None
            nbytes = 0
            in_table = False
            for kind, value in nlwire.iter_attrs(msg):
                if kind == NFTA_RULE_TABLE:
                    in_table = nlwire.text(value) == table
                elif kind == NFTA_RULE_CHAIN:
                    if not bytes(value).startswith(head):
                        break
                    chain = nlwire.text(value)
                elif kind == NFTA_RULE_EXPRESSIONS and chain is not None:
                    for _, expr in nlwire.iter_attrs(value):
                        name = data = None
                        for ekind, evalue in nlwire.iter_attrs(expr):
                            if ekind == NFTA_EXPR_NAME:
                                name = bytes(evalue).rstrip(b"\0")
                            elif ekind == NFTA_EXPR_DATA:
                                data = evalue
                        if data is None:
                            continue
                        if name == b"counter":
                            for ckind, cvalue in nlwire.iter_attrs(data):
                                if ckind == NFTA_COUNTER_BYTES:
                                    nbytes = _BE64.unpack_from(cvalue, 0)[0]
                        elif name == b"match" and comment is None:  # xt comment match (older iptables-nft)
                            found = dict(nlwire.iter_attrs(data))
                            if nlwire.text(found.get(NFTA_MATCH_NAME, b"")) == "comment":
                                comment = nlwire.text(found.get(NFTA_MATCH_INFO, b""))
                elif kind == NFTA_RULE_USERDATA and chain is not None:
                    comment = _udata_comment(value) or comment
            else:
                if chain is not None and in_table and comment:
                    out.append((chain, comment, nbytes))
        return out


def _udata_comment(data: bytes | memoryview) -> str | None:
    """The rule comment in libnftnl's user data (type, length, value records)."""
    off = 0
    while off + 2 <= len(data):
        kind, length = data[off], data[off + 1]
        if kind == NFTNL_UDATA_RULE_COMMENT:
            return nlwire.text(data[off + 2:off + 2 + length])
        off += 2 + length
    return None


# -- legacy xtables ------------------------------------------------------------------------
# struct ipt_getinfo / ipt_get_entries and the offsets of ipt_entry / ip6t_entry (linux/netfilter_ipv{4,6}/)
SO_GET_INFO, SO_GET_ENTRIES = 64, 65  # IPT_SO_GET_* and IP6T_SO_GET_* alike
_GETINFO = struct.Struct("=32sI5I5III")  # name, valid_hooks, hook_entry, underflow, num_entries, size
_GET_ENTRIES_HEAD = 40  # name[32], size, then the entries aligned to 8
# family -> (socket family, getsockopt level, offset of target_offset/next_offset, of the byte counter, of the matches)
_XT_LAYOUT = {4: (socket.AF_INET, socket.IPPROTO_IP, 88, 104, 112),
              6: (socket.AF_INET6, socket.IPPROTO_IPV6, 140, 160, 168)}
_HOOKS = ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")
_OFFSETS = struct.Struct("=HH")
_U64 = struct.Struct("=Q")
_LIBC = ctypes.CDLL(None, use_errno=True)


class XtablesReader:
    """Raw sockets of both families in a network namespace, to read legacy iptables tables."""

    def __init__(self, netns: str | None = None):
        self.socks: dict[int, socket.socket] = {}
        try:
            for family, (sfamily, *_rest) in _XT_LAYOUT.items():
                self.socks[family] = nlwire.socket_in(netns, socket.IPPROTO_RAW, sfamily)
        except OSError as exc:
            self.close()
            raise NetlinkUnavailable(f"cannot open raw sockets in network namespace {netns!r}: {exc}") from exc

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()

    def _get(self, family: int, option: int, buf: ctypes.Array) -> None:
        size = ctypes.c_uint(len(buf))
        if _LIBC.getsockopt(self.socks[family].fileno(), _XT_LAYOUT[family][1], option, buf, ctypes.byref(size)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def _entries(self, family: int, table: str) -> tuple[memoryview, dict[int, str]] | None:
        """(the table's rule blob, offset -> builtin chain starting there), None: no such table."""
        name = table.encode()
        for _ in range(5):  # the table may change between the two calls: its size then differs (EAGAIN)
            info = ctypes.create_string_buffer(name, _GETINFO.size)
            try:
                self._get(family, SO_GET_INFO, info)
                fields = _GETINFO.unpack(info.raw)
                valid, hooks, size = fields[1], fields[2:7], fields[13]
                blob = ctypes.create_string_buffer(_GET_ENTRIES_HEAD + size)
                ctypes.memmove(blob, name, len(name))
                struct.pack_into("=I", blob, 32, size)
                self._get(family, SO_GET_ENTRIES, blob)
                break
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    continue
                if exc.errno == errno.ENOENT:
                    return None
                raise NetlinkUnavailable(f"reading the legacy {table} table failed: {exc}") from exc
        else:
            raise NetlinkUnavailable(f"the legacy {table} table kept changing while it was read")
        data = memoryview(blob.raw)[_GET_ENTRIES_HEAD:_GET_ENTRIES_HEAD + size]
        return data, {hooks[i]: hook for i, hook in enumerate(_HOOKS) if valid & (1 << i)}

    def digest(self, family: int, table: str) -> bytes:
        """A digest of a legacy table's rules, counters left out: any change of a rule or chain changes it."""
        found = self._entries(family, table)
        if found is None:
            return b""
        data, _ = found
        bytes_at = _XT_LAYOUT[family][3]
        h = hashlib.blake2b(digest_size=16)
        off = 0
        while off < len(data):
            next_offset = _OFFSETS.unpack_from(data, off + _XT_LAYOUT[family][2])[1]
            if next_offset == 0:
                break
            h.update(data[off:off + bytes_at - 8])  # up to the packet and byte counters
            h.update(data[off + bytes_at + 8:off + next_offset])
            off += next_offset
        return h.digest()

    def rule_counters(self, family: int, table: str, prefix: str) -> list[tuple[str, str, int]]:
        """(chain, comment, bytes) of every commented rule in `prefix`-chains of a legacy table, in
        the kernel's order: what `counted_comments` finds in `iptables-legacy-save -c -t <table>`."""
        _, _, offsets_at, bytes_at, matches_at = _XT_LAYOUT[family]
        found = self._entries(family, table)
        if found is None:
            return []
        data, starts = found
        size = len(data)
        out: list[tuple[str, str, int]] = []
        head = prefix + "-"
        chain = ""
        off = 0
        while off < size:
            target_offset, next_offset = _OFFSETS.unpack_from(data, off + offsets_at)
            if next_offset == 0:
                break
            if off in starts:
                chain = starts[off]
            target = off + target_offset
            if bytes(data[target + 2:target + 8]) == b"ERROR\0":  # a user chain's head: its name is the data
                chain = nlwire.text(data[target + 32:off + next_offset])
            elif chain.startswith(head):
                comment = None
                m = off + matches_at
                while m < target:
                    (match_size,) = struct.unpack_from("=H", data, m)
                    if match_size == 0:
                        break
                    if bytes(data[m + 2:m + 10]) == b"comment\0":
                        comment = nlwire.text(data[m + 32:m + match_size])
                    m += match_size
                if comment:
                    out.append((chain, comment, _U64.unpack_from(data, off + bytes_at)[0]))
            off += next_offset
        return out
