"""What a file given on the command line is, from its first bytes, so an error can say what was given instead of
what was expected (a PNG as a config, a YAML file as a checkpoint)."""

from pathlib import Path

# First bytes of the kinds of file a user is likely to give by mistake (https://en.wikipedia.org/wiki/List_of_file_signatures)
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
               (b"%PDF", "a PDF document"), (b"\x1f\x8b", "a gzip file"), (b"\x7fELF", "an executable (ELF)"),
               (b"PK\x03\x04", "a zip archive"), (b"PK\x05\x06", "an empty zip archive"))
_PICKLE_PROTOCOL = b"\x80"  # pickle protocol 2+ opens with PROTO; torch's legacy (pre-1.6) format is a pickle


def what_is(path: str | Path) -> str:
    """A few words saying what `path` is: "a folder", "an empty file", "a PNG image", "a zip archive",
    "a pickle", "a text file", "a binary file", "no such file".

    Args:
        path: Any path; only its first 4 KiB are read.
    """
    path = Path(path)
    if path.is_dir():
        return "a folder"
    if not path.exists():
        return "no such file"
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as err:
        return f"a file that cannot be read ({err.strerror or err})"
    if not head:
        return "an empty file"
    for signature, kind in _SIGNATURES:
        if head.startswith(signature):
            return kind
    if head.startswith(_PICKLE_PROTOCOL):
        return "a pickle"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 4:  # not just a character cut at the end of the 4 KiB read
            return "a binary file"
    return "a text file"
