"""Media loading: an image URL from a request, turned into a decoded RGB `PIL.Image` under a policy.

Owns the `MediaPolicy` (the `--allowed-local-media-path`, `--allowed-media-domains`,
`--media-fetch-timeout` and `--max-image-pixels` flags, plus a byte cap), the user-facing
`MediaError`, and three pure synchronous functions: `load_image` (data:, file://, http(s)://),
`decode_image` (bytes -> RGB image, pixel count checked before decoding) and `image_hash` (the
content key of the processed-image cache and of prefix-cache block hashes).

Everything here blocks (network, disk, decoding), so the frontend's renderer pool calls it from
worker threads, never from the trio event loop. No trio, no torch.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.client
import io
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPMessage, HTTPResponse
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit
from urllib.request import Request

from PIL import Image, UnidentifiedImageError

_SCHEMES_HINT = "use http://, https://, data: or file://"
_READ_CHUNK = 64 * 1024
# Pillow's EPS reader runs Ghostscript in a subprocess on the input: not for untrusted bytes.
_REFUSED_FORMATS = frozenset({"EPS"})


@dataclass(frozen=True)
class MediaPolicy:
    """What image URLs a server accepts and how much work one image may cost.

    Attributes:
        allowed_local_media_path: `--allowed-local-media-path`: file:// URLs are read only from
            under this directory (symlinks followed, `..` resolved); None refuses file:// URLs.
        allowed_media_domains: `--allowed-media-domains`: http(s) hosts allowed, matched
            exactly and case-insensitively, on every redirect hop too. None allows any host,
            loopback included (as vLLM); an empty tuple allows none.
        fetch_timeout: `--media-fetch-timeout`, seconds for a whole http(s) fetch.
        max_fetch_bytes: the largest encoded image accepted from any source.
        max_image_pixels: `--max-image-pixels`: width * height cap checked before decoding.
            None keeps Pillow's decompression-bomb limit (`PIL.Image.MAX_IMAGE_PIXELS`); a value
            can lower that limit, not raise it.
    """

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout: float = 10.0
    max_fetch_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int | None = None

    def __post_init__(self) -> None:
        if not self.fetch_timeout > 0:
            raise ValueError(f"--media-fetch-timeout must be > 0, got {self.fetch_timeout}")
        if self.max_fetch_bytes < 1:
            raise ValueError(f"max_fetch_bytes must be >= 1, got {self.max_fetch_bytes}")
        if self.max_image_pixels is not None and self.max_image_pixels < 1:
            raise ValueError(f"--max-image-pixels must be >= 1, got {self.max_image_pixels}")


class MediaError(ValueError):
    """Why an image part cannot be used: the message is user-facing (becomes a 400)."""


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    """Fetch or read the image a URL names and decode it to RGB (see `decode_image`).

    `url` is a `data:[<mediatype>][;<param>]*;base64,<data>` URL (the media type may be empty
    and is ignored: Pillow sniffs the format), a `file:///path` URL or an http(s) URL.

    Raises:
        MediaError: the policy refuses the URL, it cannot be fetched or read, or it holds no
            image within the limits; the message names the URL (truncated) and why.
    """
    url = url.strip()
    if url[:5].lower() == "data:":
        return decode_image(_data_url_bytes(url, policy), policy)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return decode_image(_fetch_http(url, policy), policy)
    if scheme == "file":
        return decode_image(_read_file(url, policy), policy)
    if not scheme:
        raise MediaError(f"image URL {_short(url)} has no scheme: {_SCHEMES_HINT}")
    raise MediaError(f"unsupported scheme '{scheme}:' in image URL {_short(url)}: "
                     f"{_SCHEMES_HINT}")


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Decode encoded image bytes into a fully loaded RGB image.

    Any format Pillow reads (PNG, JPEG, WebP, GIF: its first frame, ...) except EPS. The pixel
    count in the header is checked against the cap before any pixel is decoded. Transparency is
    composited onto white and other modes converted to RGB, as vLLM's image loader does; EXIF
    orientation is not applied (Hugging Face processors do not apply it either).

    Raises:
        MediaError: not an image Pillow can read (or truncated), or over the pixel cap.
    """
    try:
        image = Image.open(io.BytesIO(data), formats=_readable_formats())
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image refused by Pillow's decompression-bomb limit: {exc}") from exc
    except UnidentifiedImageError as exc:
        # Pillow's own message names the BytesIO object and its address: no use to a client.
        raise MediaError("not an image Pillow can read: unrecognized format") from exc
    except Exception as exc:  # Pillow's parsers raise many types on hostile bytes.
        raise MediaError(f"not an image Pillow can read: {_reason(exc)}") from exc
    width, height = image.size
    cap = _pixel_cap(policy)
    if cap is not None and width * height > cap:
        raise MediaError(f"image is {width}x{height} = {width * height} pixels, over the limit "
                         f"of {cap} (--max-image-pixels)")
    try:
        image.load()
        return to_rgb(image)
    except Exception as exc:  # truncated data surfaces here, after a good header
        raise MediaError(f"not an image Pillow can read: {_reason(exc)}") from exc


def image_hash(image: Image.Image) -> str:
    """A hex sha256 of an image's decoded pixels, mode and size.

    The same picture gets the same hash however it was encoded (PNG, lossless WebP, another
    data URL), so it keys the processed-image cache and feeds prefix-cache block hashes.
    """
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _data_url_bytes(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError(f"data URL {_short(url)} has no ',' before its data")
    # RFC 2397: data:[<mediatype>][;<param>]*[;base64],<data>. Like vLLM, only base64 is taken.
    _, semicolon, encoding = header.rpartition(";")
    if not semicolon or encoding.strip().lower() != "base64":
        raise MediaError(f"data URL {_short(url)} is not base64: only "
                         "data:[<mediatype>];base64,<data> URLs are supported")
    if len(payload) // 4 * 3 > policy.max_fetch_bytes:
        raise MediaError(f"data URL {_short(url)} holds more than {policy.max_fetch_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as exc:  # binascii.Error (padding, alphabet) or non-ASCII text
        raise MediaError(f"invalid base64 in data URL {_short(url)}: {exc}") from exc


def _read_file(url: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError(f"file URLs are refused ({_short(url)}): start the server with "
                         "--allowed-local-media-path DIR to allow images under DIR")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file URL {_short(url)} names host '{parts.netloc}': "
                         "use file:///absolute/path")
    given = urllib.request.url2pathname(parts.path)
    try:
        # resolve() follows symlinks and folds `..`, so the check sees the file actually read.
        path = Path(given).resolve()
        inside = path.is_relative_to(Path(root).resolve())
    except (OSError, ValueError) as exc:
        raise MediaError(f"bad file path in {_short(url)}: {_reason(exc)}") from exc
    if not inside:
        raise MediaError(f"file {given!r} is outside --allowed-local-media-path {root!r}")
    # Checked before open(): opening a FIFO would block the worker until a writer appears.
    if not path.is_file():
        what = "not a regular file" if path.exists() else "no such file"
        raise MediaError(f"cannot read image file {given!r}: {what}")
    try:
        with path.open("rb") as file:
            data = file.read(policy.max_fetch_bytes + 1)
    except OSError as exc:
        raise MediaError(f"cannot read image file {given!r}: {_reason(exc)}") from exc
    if len(data) > policy.max_fetch_bytes:
        raise MediaError(f"image file {given!r} is over the {policy.max_fetch_bytes}-byte limit")
    return data


def _fetch_http(url: str, policy: MediaPolicy) -> bytes:
    _check_host(url, policy)
    opener = urllib.request.build_opener(_PolicyRedirects(policy))
    request = Request(url, headers={"User-Agent": "ringserve", "Accept": "image/*"})
    deadline = time.monotonic() + policy.fetch_timeout
    failed = f"fetching {_short(url)} failed"
    try:
        # The timeout bounds connecting and each read; the deadline bounds the whole body, so a
        # server trickling bytes is cut off within one read timeout past it.
        with opener.open(request, timeout=policy.fetch_timeout) as response:
            return _read_body(response, url, policy, deadline)
    except MediaError:
        raise
    except urllib.error.HTTPError as exc:
        exc.close()
        raise MediaError(f"{failed}: HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        raise MediaError(f"{failed}: {_net_reason(exc.reason, policy)}") from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise MediaError(f"{failed}: {_net_reason(exc, policy)}") from exc


def _read_body(response: HTTPResponse, url: str, policy: MediaPolicy, deadline: float) -> bytes:
    cap = policy.max_fetch_bytes
    length = (response.headers.get("Content-Length") or "").strip()
    if length.isdigit() and int(length) > cap:
        raise MediaError(f"{_short(url)} is {int(length)} bytes, over the {cap}-byte limit")
    chunks: list[bytes] = []
    total = 0
    # Content-Length may be absent (or lie): the cap holds on the bytes that actually arrive.
    while chunk := response.read1(_READ_CHUNK):
        total += len(chunk)
        if total > cap:
            raise MediaError(f"{_short(url)} sent more than the {cap}-byte limit")
        if time.monotonic() > deadline:
            timed_out = _net_reason(TimeoutError(), policy)
            raise MediaError(f"fetching {_short(url)} failed: {timed_out}")
        chunks.append(chunk)
    return b"".join(chunks)


class _PolicyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects only to http(s) URLs the policy allows: each hop is checked."""

    def __init__(self, policy: MediaPolicy) -> None:
        super().__init__()
        self._policy = policy

    def redirect_request(self, req: Request, fp: IO[bytes], code: int, msg: str,
                         headers: HTTPMessage, newurl: str) -> Request | None:
        try:
            if urlsplit(newurl).scheme.lower() not in ("http", "https"):
                raise MediaError(f"{_short(req.full_url)} redirects to a non-http(s) URL "
                                 f"{_short(newurl)}")
            _check_host(newurl, self._policy)
        except MediaError:
            fp.close()  # the redirect response is not handed to anyone who would close it
            raise
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_host(url: str, policy: MediaPolicy) -> None:
    host = urlsplit(url).hostname  # lower-cased, IPv6 brackets removed
    if not host:
        raise MediaError(f"image URL {_short(url)} has no host")
    allowed = policy.allowed_media_domains
    if allowed is not None and host not in {domain.lower() for domain in allowed}:
        raise MediaError(f"host '{host}' of {_short(url)} is not in --allowed-media-domains "
                         f"({', '.join(allowed) or 'none'})")


def to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    # As vLLM's convert_image_mode: transparent pixels become white rather than their hidden
    # color (often black), which is what a viewer shows and what the model was tuned on.
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    return image.convert("RGB")


def _pixel_cap(policy: MediaPolicy) -> int | None:
    limits = [cap for cap in (policy.max_image_pixels, Image.MAX_IMAGE_PIXELS) if cap is not None]
    return min(limits) if limits else None


@functools.cache
def _readable_formats() -> tuple[str, ...]:
    Image.init()  # fills Image.OPEN with every plugin Pillow has
    return tuple(name for name in Image.OPEN if name not in _REFUSED_FORMATS)


def _net_reason(reason: str | BaseException, policy: MediaPolicy) -> str:
    if isinstance(reason, TimeoutError):
        return f"timed out after {policy.fetch_timeout:g} s (--media-fetch-timeout)"
    if isinstance(reason, socket.gaierror):
        return f"cannot resolve host ({reason.strerror})"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    return _reason(reason)


def _reason(reason: str | BaseException) -> str:
    """One line for a message: the first line of the text, else the exception's type."""
    text = str(reason).strip().partition("\n")[0]
    return text or type(reason).__name__


def _short(url: str) -> str:
    """The URL quoted for a message: one line, at most ~60 characters (data URLs are long)."""
    return repr(url if len(url) <= 60 else url[:57] + "...")
