"""A multipart upload (`POST /v1/files`) read as it streams, within its limits.

Starlette's form parser spools file parts to temporary files of unbounded size (outside the storage
directory) and only the caller can check the size afterwards: a chunked body without a
Content-Length was read and written whole before its 413. Here every byte is counted as it
arrives: the body stops being read, and the request is answered 413, as soon as it passes the
file limit plus `MULTIPART_OVERHEAD` (the boundaries, part headers and the small form fields), or
its file part passes the file limit. The file part is kept in memory (it is stored from memory
anyway, gateway/batches/blobs.py), never in a temporary file; at most one file part and a few
small fields are taken.

    read_upload(request, max_file_bytes) -> Upload(fields, file, filename)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from gateway.errors import APIError, ErrorKind, invalid_request

# Room for what a multipart body holds besides the file's bytes.
MULTIPART_OVERHEAD = 64 * 1024
MAX_FIELDS = 8
MAX_FIELD_BYTES = 1024


@dataclass
class Upload:
    """The form: its fields (name -> text) and its one file part's bytes and filename."""

    fields: dict[str, str] = field(default_factory=dict)
    file_field: str | None = None
    file: bytes | None = None
    filename: str | None = None


class _TooLarge(Exception):
    pass


class _Invalid(Exception):
    pass


class _Form:
    """python-multipart's callbacks, gathering one form within the limits."""

    def __init__(self, max_file_bytes: int) -> None:
        self.max_file_bytes = max_file_bytes
        self.upload = Upload()
        self._data = bytearray()
        self._name = ""
        self._is_file = False
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._num_parts = 0

    def on_part_begin(self) -> None:
        self._data = bytearray()
        self._disposition = b""
        self._num_parts += 1
        if self._num_parts > MAX_FIELDS:
            raise _Invalid(f"Too many form fields (at most {MAX_FIELDS}).")

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if bytes(self._header_field).lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_field, self._header_value = bytearray(), bytearray()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise _Invalid('A form part has no name (Content-Disposition: form-data; name="...").')
        self._name = options[b"name"].decode("utf-8", "replace")
        self._is_file = b"filename" in options
        if self._is_file:
            if self.upload.file_field is not None:
                raise _Invalid("Only one file may be uploaded at a time.")
            self.upload.file_field = self._name
            self.upload.filename = options[b"filename"].decode("utf-8", "replace")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        limit = self.max_file_bytes if self._is_file else MAX_FIELD_BYTES
        if len(self._data) + (end - start) > limit:
            if self._is_file:
                raise _TooLarge
            raise _Invalid(f"The form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes.")
        self._data += data[start:end]

    def on_part_end(self) -> None:
        if self._is_file:
            self.upload.file = bytes(self._data)
        else:
            self.upload.fields[self._name] = self._data.decode("utf-8", "replace")
        self._data = bytearray()

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
        }


def too_large(max_file_bytes: int) -> APIError:
    return APIError(
        ErrorKind.REQUEST_TOO_LARGE, f"The file is larger than this server accepts ({max_file_bytes} bytes)."
    )


async def read_upload(request: Request, max_file_bytes: int) -> Upload:
    """The multipart form of `request`, read as it streams (see the module docstring); APIError
    415 (not multipart), 413 (too large: nothing more is read) or 400 (malformed)."""
    content_type = request.headers.get("content-type", "")
    media_type, options = parse_options_header(content_type)
    if media_type != b"multipart/form-data":
        shown = media_type.decode("latin-1") or "nothing"
        raise APIError(ErrorKind.UNSUPPORTED_MEDIA_TYPE, f"Uploads are multipart/form-data, got {shown!r}.")
    boundary = options.get(b"boundary")
    if not boundary:
        raise invalid_request("The multipart Content-Type has no boundary.")
    limit = max_file_bytes + MULTIPART_OVERHEAD
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(max_file_bytes)  # refused before a byte of the body is read
    form = _Form(max_file_bytes)
    parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
    num_bytes = 0
    try:
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > limit:
                raise _TooLarge
            parser.write(chunk)
        parser.finalize()
    except _TooLarge:
        raise too_large(max_file_bytes) from None
    except _Invalid as exc:
        raise invalid_request(str(exc)) from None
    except MultipartParseError:
        raise invalid_request("The body is not valid multipart/form-data.") from None
    except ClientDisconnect:
        raise invalid_request("The client disconnected while sending the file.") from None
    return form.upload
