"""Input files read as UTF-8: a file that is not says which file, which line and which byte, instead of
a bare ``UnicodeDecodeError`` from deep inside a loader."""

from __future__ import annotations

from pathlib import Path


class NotUtf8Error(ValueError):
    """``file``'s byte ``offset`` (0-based, on 1-based ``line``) does not decode as UTF-8."""

    def __init__(self, file: Path, line: int, offset: int, byte: int):
        self.file, self.line, self.offset, self.byte = Path(file), line, offset, byte
        self.message = f"not UTF-8: byte 0x{byte:02x} at offset {offset} (line {line})"
        super().__init__(f"{self.file}:{line}: {self.message}")


def decode_utf8(data: bytes, file: Path) -> str:
    """``data`` (the content of ``file``) as text; ``NotUtf8Error`` at the first undecodable byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotUtf8Error(file, data.count(b"\n", 0, e.start) + 1, e.start, data[e.start]) from None


def read_utf8(path: Path) -> str:
    """The text of an input file; ``NotUtf8Error`` (file, line, byte offset) where it is not UTF-8."""
    path = Path(path)
    return decode_utf8(path.read_bytes(), path)
