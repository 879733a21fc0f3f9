"""An asset upload's body, as Workers AI takes it: `multipart/form-data` with a `file` part and a
`file_name` field (curl's `-F file=@adapter_model.safetensors -F file_name=adapter_model.safetensors`).
Read from the whole body, by python-multipart, the same way on nodes and routers."""

from __future__ import annotations

from dataclasses import dataclass

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from edgeinfer.api.errors import bad_request

_FIELDS = {b"file", b"file_name"}


@dataclass
class _Part:
    name: bytes = b""
    data: bytearray | None = None


def read_upload(content_type: str | None, body: bytes) -> tuple[str, bytes]:
    """(file_name, the file's bytes); 400 for a body that is not such a form. `file_name` defaults to
    the file part's own file name."""
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise bad_request("an asset is uploaded as multipart/form-data with `file` and `file_name`", "file")
    parts, filenames = _parse(boundary, body)
    if b"file" not in parts:
        raise bad_request("the form has no `file` part", "file")
    raw_name = parts.get(b"file_name")
    try:
        file_name = raw_name.decode() if raw_name is not None else filenames.get(b"file", "")
    except UnicodeDecodeError:
        raise bad_request("file_name is not UTF-8", "file_name") from None
    return file_name, bytes(parts[b"file"])


def _parse(boundary: bytes, body: bytes) -> tuple[dict[bytes, bytearray], dict[bytes, str]]:
    parts: dict[bytes, bytearray] = {}
    filenames: dict[bytes, str] = {}
    current = _Part()
    header: list[bytes] = [b"", b""]

    def on_part_begin() -> None:
        nonlocal current
        current = _Part()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        if header[0].lower() == b"content-disposition":
            _, options = parse_options_header(header[1])
            current.name = options.get(b"name", b"")
            if b"filename" in options:
                filenames[current.name] = options[b"filename"].decode("utf-8", "replace")
        header[0], header[1] = b"", b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if current.name in _FIELDS:
            if current.data is None:
                if current.name in parts:
                    raise bad_request(f"the form has more than one {current.name.decode()!r} part", "file")
                current.data = parts[current.name] = bytearray()
            current.data += data[start:end]

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise bad_request(f"the multipart body cannot be read: {exc}", "file") from None
    return parts, filenames
