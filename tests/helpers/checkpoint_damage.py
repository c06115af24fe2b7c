"""A checkpoint damaged as a bad copy or disk damages one: bytes changed inside a member, its zip directory whole."""

import zipfile
from pathlib import Path


def overwrite_inside_largest_tensor(path: Path, count: int = 2000) -> str:
    """Invert `count` bytes in the middle of the largest member's data (found from the zip's own offsets: the
    local header is 30 bytes plus the name and the extra field); returns that member's name."""
    with zipfile.ZipFile(path) as archive:
        largest = max(archive.infolist(), key=lambda info: info.file_size)
    assert largest.compress_type == zipfile.ZIP_STORED and largest.file_size > 2 * count
    raw = bytearray(path.read_bytes())
    header = raw[largest.header_offset:largest.header_offset + 30]
    assert header[:4] == b"PK\x03\x04"
    start = largest.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
        int.from_bytes(header[28:30], "little") + largest.file_size // 2 - count // 2
    raw[start:start + count] = bytes(b ^ 0xFF for b in raw[start:start + count])
    path.write_bytes(raw)
    return largest.filename
