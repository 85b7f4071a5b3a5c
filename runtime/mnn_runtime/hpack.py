"""HPACK (RFC 7541), as much as a gRPC server needs: a full decoder (static and dynamic tables,
Huffman strings) and an encoder of literal fields that never touches the peer's dynamic table.

Pure Python, tuned for the gRPC hot path: a header block that only refers to table entries (what
nghttp2 and grpc-core send once their tables are warm) is decoded once and then served from a cache
until the dynamic table changes; Huffman strings are decoded four bits at a time by a state table
built at import (~10 ms) from the code lengths of RFC 7541 Appendix B (a canonical code).
"""

from __future__ import annotations

STATIC_TABLE: tuple[tuple[str, str], ...] = (
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"), (":path", "/index.html"),
    (":scheme", "http"), (":scheme", "https"), (":status", "200"), (":status", "204"), (":status", "206"),
    (":status", "304"), (":status", "400"), (":status", "404"), (":status", "500"), ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""), ("accept", ""),
    ("access-control-allow-origin", ""), ("age", ""), ("allow", ""), ("authorization", ""), ("cache-control", ""),
    ("content-disposition", ""), ("content-encoding", ""), ("content-language", ""), ("content-length", ""),
    ("content-location", ""), ("content-range", ""), ("content-type", ""), ("cookie", ""), ("date", ""),
    ("etag", ""), ("expect", ""), ("expires", ""), ("from", ""), ("host", ""), ("if-match", ""),
    ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""), ("if-unmodified-since", ""),
    ("last-modified", ""), ("link", ""), ("location", ""), ("max-forwards", ""), ("proxy-authenticate", ""),
    ("proxy-authorization", ""), ("range", ""), ("referer", ""), ("refresh", ""), ("retry-after", ""),
    ("server", ""), ("set-cookie", ""), ("strict-transport-security", ""), ("transfer-encoding", ""),
    ("user-agent", ""), ("vary", ""), ("via", ""), ("www-authenticate", ""),
)

# Code length in bits of each symbol 0..256 (256 = EOS), RFC 7541 Appendix B, as chr(48 + length);
# the code is canonical (codes of one length are consecutive, in symbol order), so the lengths
# define it.
_LENGTHS = (
    "=GLLLLLLLHNLLNLLLLLLLLNLLLLLLLLL6::<=68;::8;8666555666666678?6<:"
    "=67777777777777777777777878=C=>6?56565666577666567655677777?;>=L"
    "DFDDFFFGFGGGGGHGHHFGHGGGGEFGFGGHFEDFFGGEGFFHEFGGEEFEGFGGDFFFGFFG"
    "JJDCFGFIJJJKKJHICEJKKJKHEEJJLKKKDHDEFEEGFFIIHHJGJKJJKKKKKLKKKKKJ"
    "N"
)
assert len(_LENGTHS) == 257


class HPACKError(ValueError):
    """A header block that does not decode (a COMPRESSION_ERROR of the connection)."""


def _huffman_tables() -> tuple[list[tuple[int, bytes | None]], list[bool]]:
    """(transitions, accepting): transitions[state * 16 + nibble] = (next state, bytes emitted, or
    None when EOS was decoded); accepting[state]: a string may end there (padding is fewer than
    8 bits, all ones)."""
    lengths = [ord(c) - ord("0") for c in _LENGTHS]
    children: list[list[int]] = [[-1, -1]]  # internal nodes; a child < -1 is leaf -(symbol + 2)
    code, previous = 0, 0
    for i, sym in enumerate(sorted(range(257), key=lambda s: (lengths[s], s))):
        if i:
            code = (code + 1) << (lengths[sym] - previous)
        previous = lengths[sym]
        node = 0
        for bit in range(lengths[sym] - 1, -1, -1):
            b = (code >> bit) & 1
            if bit == 0:
                children[node][b] = -(sym + 2)
            else:
                if children[node][b] == -1:
                    children.append([-1, -1])
                    children[node][b] = len(children) - 1
                node = children[node][b]
    # a state's depth and whether its path is all ones (valid padding when < 8 bits)
    depth, ones = [0] * len(children), [True] * len(children)
    for node, kids in enumerate(children):
        for b, kid in enumerate(kids):
            if kid >= 0:
                depth[kid], ones[kid] = depth[node] + 1, ones[node] and b == 1
    accepting = [node == 0 or (ones[node] and depth[node] < 8) for node in range(len(children))]
    transitions: list[tuple[int, bytes | None]] = []
    for node in range(len(children)):
        for nibble in range(16):
            state, out, bad = node, bytearray(), False
            for bit in (3, 2, 1, 0):
                kid = children[state][(nibble >> bit) & 1]
                if kid < -1:
                    sym = -kid - 2
                    bad = bad or sym == 256
                    out.append(sym & 0xFF)
                    state = 0
                else:
                    state = kid
            transitions.append((state, None if bad else bytes(out)))
    return transitions, accepting


_HUFFMAN, _ACCEPTING = _huffman_tables()


def huffman_decode(data: bytes) -> bytes:
    table, state, out = _HUFFMAN, 0, bytearray()
    for byte in data:
        state, emitted = table[(state << 4) | (byte >> 4)]
        if emitted is None:
            raise HPACKError("Huffman string holds EOS")
        out += emitted
        state, emitted = table[(state << 4) | (byte & 15)]
        if emitted is None:
            raise HPACKError("Huffman string holds EOS")
        out += emitted
    if not _ACCEPTING[state]:
        raise HPACKError("Huffman string ends in invalid padding")
    return bytes(out)


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """(value, next position) of the integer whose first byte is at ``pos`` with a ``prefix``-bit prefix."""
    limit = (1 << prefix) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block):
            raise HPACKError("integer runs past the end of the header block")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
        if shift > 28:
            raise HPACKError("integer too large")


_decoded: dict[bytes, str] = {}  # Huffman string -> text, shared by every connection (bounded)


class Decoder:
    """One connection's decoding context (its dynamic table); ``max_size`` is the table size this
    end announced (SETTINGS_HEADER_TABLE_SIZE)."""

    def __init__(self, max_size: int = 4096, max_strings: int = 16384, max_list: int = 1 << 16) -> None:
        self.max_size = max_size
        self.size_limit = max_size  # as last set by the peer's size update
        self.table: list[tuple[str, str]] = []  # newest first
        self.size = 0
        self.max_strings = max_strings  # one string's longest length (a bound on memory, not on the peer)
        self.max_list = max_list  # the decoded list's largest size (as SETTINGS_MAX_HEADER_LIST_SIZE counts)
        self._generation = 0  # bumped on every change of the dynamic table
        self._cache: dict[bytes, tuple[int, list[tuple[str, str]]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        cached = self._cache.get(block)
        if cached is not None and cached[0] == self._generation:
            return cached[1]
        generation = self._generation
        headers = self._decode(block)
        if self._generation == generation and len(block) <= 256:
            if len(self._cache) >= 256:
                self._cache.clear()
            self._cache[block] = (generation, headers)
        return headers

    def _entry(self, index: int) -> tuple[str, str]:
        if 0 < index <= 61:
            return STATIC_TABLE[index - 1]
        if 61 < index <= 61 + len(self.table):
            return self.table[index - 62]
        raise HPACKError(f"index {index} is not in the table")

    def _string(self, block: bytes, pos: int) -> tuple[str, int]:
        if pos >= len(block):
            raise HPACKError("string runs past the end of the header block")
        huffman = block[pos] & 0x80
        length, pos = _integer(block, pos, 7)
        end = pos + length
        if end > len(block) or length > self.max_strings:
            raise HPACKError("string runs past the end of the header block")
        raw = block[pos:end]
        if not huffman:
            return raw.decode("latin-1"), end
        text = _decoded.get(raw)  # user keys and timeouts repeat: decode each once
        if text is None:
            text = huffman_decode(raw).decode("latin-1")
            if length <= 128:  # short ones only: the cache outlives the connection
                if len(_decoded) >= 4096:
                    _decoded.clear()
                _decoded[raw] = text
        return text, end

    def _add(self, name: str, value: str) -> None:
        self._generation += 1
        size = len(name) + len(value) + 32
        self.table.insert(0, (name, value))
        self.size += size
        self._evict()

    def _evict(self) -> None:
        while self.size > self.size_limit and self.table:
            name, value = self.table.pop()
            self.size -= len(name) + len(value) + 32

    def _decode(self, block: bytes) -> list[tuple[str, str]]:
        headers: list[tuple[str, str]] = []
        pos, end, first = 0, len(block), True
        room = self.max_list  # left of the list limit: one indexed byte can name a 4 KB entry
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                name, value = field = self._entry(index)
                headers.append(field)
            elif byte & 0x40:  # literal with incremental indexing
                name, value, pos = self._literal(block, pos, 6)
                headers.append((name, value))
                self._add(name, value)
            elif byte & 0x20:  # dynamic table size update: only before the first field
                if not first:
                    raise HPACKError("table size update after a header field")
                size, pos = _integer(block, pos, 5)
                if size > self.max_size:
                    raise HPACKError(f"table size {size} is over the {self.max_size} announced")
                self._generation += 1
                self.size_limit = size
                self._evict()
                continue
            else:  # literal without indexing (0000) or never indexed (0001)
                name, value, pos = self._literal(block, pos, 4)
                headers.append((name, value))
            first = False
            room -= len(name) + len(value) + 32
            if room < 0:
                raise HPACKError(f"header list over {self.max_list} bytes")
        return headers

    def _literal(self, block: bytes, pos: int, prefix: int) -> tuple[str, str, int]:
        """A literal field: its name (indexed, or a string when the index is 0), its value, and
        where the next field starts."""
        index, pos = _integer(block, pos, prefix)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = self._string(block, pos)
        value, pos = self._string(block, pos)
        return name, value, pos


def encode_integer(value: int, prefix: int, flags: int = 0) -> bytes:
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes((flags | value,))
    out = bytearray((flags | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: str, value: str | bytes) -> bytes:
    """A literal field without indexing and with a literal name: the peer's table is never changed,
    so the encoder keeps no state. Strings go as they are (no Huffman)."""
    raw_name = name.encode("latin-1")
    raw_value = value.encode("latin-1") if isinstance(value, str) else value
    return (b"\x00" + encode_integer(len(raw_name), 7) + raw_name
            + encode_integer(len(raw_value), 7) + raw_value)


def encode_indexed_name(index: int, value: str | bytes) -> bytes:
    """A literal field without indexing whose name is entry ``index`` of the static table."""
    raw_value = value.encode("latin-1") if isinstance(value, str) else value
    return encode_integer(index, 4) + encode_integer(len(raw_value), 7) + raw_value
