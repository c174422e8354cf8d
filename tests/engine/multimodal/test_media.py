"""Media loading: data:, file:// and http(s) image URLs under a `MediaPolicy`, decoding, hashing.

Images are built in memory with Pillow; http is a local `http.server` on 127.0.0.1 in a thread.
"""

from __future__ import annotations

import base64
import io
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from ringserve.engine.frontend.multimodal.media import (
    MediaError,
    MediaPolicy,
    decode_image,
    image_hash,
    load_image,
)

POLICY = MediaPolicy()
RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def _picture(width: int = 8, height: int = 6) -> Image.Image:
    """A small RGB image with distinct pixels, so lossless round trips are checkable."""
    image = Image.new("RGB", (width, height))
    image.putdata([(x * 30 % 256, y * 40 % 256, (x + y) * 7 % 256)
                   for y in range(height) for x in range(width)])
    return image


def _encode(image: Image.Image, fmt: str, **params: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_header(width: int, height: int) -> bytes:
    """A PNG claiming a size, cut off a few bytes into its pixel data (IDAT)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


# --- data: URLs and decoding -------------------------------------------------------------------

@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                      ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_data_url_formats_decode_to_loaded_rgb(fmt: str, mime: str) -> None:
    picture = _picture()
    image = load_image(_data_url(_encode(picture, fmt), mime), POLICY)
    assert image.mode == "RGB" and image.size == picture.size
    if fmt == "PNG":
        assert image.tobytes() == picture.tobytes()


@pytest.mark.parametrize("prefix", ["data:;base64,", "data:image/png;name=a.png;base64,",
                                    "DATA:image/png;BASE64,", "data:text/plain;base64,"])
def test_data_url_header_forms_vllm_accepts(prefix: str) -> None:
    payload = base64.b64encode(_encode(_picture(), "PNG")).decode()
    assert load_image(prefix + payload, POLICY).tobytes() == _picture().tobytes()


@pytest.mark.parametrize("url,why", [
    ("data:image/png,iVBORw0KGgo=", "is not base64"),
    ("data:base64,iVBORw0KGgo=", "is not base64"),
    ("data:image/png;base64", "has no ','"),
    ("data:image/png;base64,iVBORw0KGgoAAAANSUhEU", "invalid base64 in data URL"),
    ("data:image/png;base64,iVBO@@==", "invalid base64 in data URL"),
    ("data:image/png;base64,iVBOÄÖ==", "invalid base64 in data URL"),
])
def test_bad_data_urls_are_refused(url: str, why: str) -> None:
    with pytest.raises(MediaError, match=why):
        load_image(url, POLICY)


def test_messages_are_one_line_and_never_hold_the_whole_data_url() -> None:
    url = "data:image/png;base64," + "A" * 10_001 + "\n"
    with pytest.raises(MediaError) as info:
        load_image(url, POLICY)
    message = str(info.value)
    assert "invalid base64" in message and "\n" not in message and len(message) < 200


def test_data_url_over_the_byte_cap_is_refused_before_decoding() -> None:
    url = _data_url(_encode(_picture(), "PNG"))
    with pytest.raises(MediaError, match="more than 16 bytes"):
        load_image(url, MediaPolicy(max_fetch_bytes=16))


def test_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), RED), Image.new("RGB", (4, 4), BLUE)]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    image = decode_image(data, POLICY)
    assert image.mode == "RGB" and set(image.get_flattened_data()) == {RED}


def test_transparency_becomes_white_and_opaque_pixels_keep_their_color() -> None:
    rgba = Image.new("RGBA", (2, 1))
    rgba.putdata([(255, 0, 0, 255), (0, 0, 0, 0)])
    image = decode_image(_encode(rgba, "PNG"), POLICY)
    assert image.mode == "RGB" and list(image.get_flattened_data()) == [RED, WHITE]
    gray_alpha = Image.new("LA", (1, 1), (0, 0))
    assert list(decode_image(_encode(gray_alpha, "PNG"), POLICY).get_flattened_data()) == [WHITE]


@pytest.mark.parametrize("mode,fmt", [("L", "PNG"), ("P", "PNG"), ("1", "PNG"),
                                      ("CMYK", "JPEG"), ("I;16", "PNG")])
def test_other_modes_convert_to_rgb(mode: str, fmt: str) -> None:
    image = decode_image(_encode(_picture().convert(mode), fmt), POLICY)
    assert image.mode == "RGB" and image.size == (8, 6)


def test_exif_orientation_is_not_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    image = decode_image(_encode(_picture(8, 6), "JPEG", exif=exif), POLICY)
    assert image.size == (8, 6)


@pytest.mark.parametrize("data", [b"", b"hello, world", b"GIF89a" + b"\0" * 3])
def test_not_an_image(data: bytes) -> None:
    with pytest.raises(MediaError, match="not an image Pillow can read"):
        decode_image(data, POLICY)


def test_truncated_image_is_refused_when_its_pixels_are_decoded() -> None:
    data = _encode(_picture(64, 64), "PNG")
    with pytest.raises(MediaError, match=r"not an image Pillow can read: .*truncated"):
        decode_image(data[: len(data) // 2], POLICY)


def test_eps_is_not_opened() -> None:
    # Pillow would open it, and decoding it would run Ghostscript on the request's bytes.
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\nshowpage\n"
    assert Image.open(io.BytesIO(eps)).format == "EPS"
    with pytest.raises(MediaError, match="not an image Pillow can read"):
        decode_image(eps, POLICY)


def test_pixel_cap_is_checked_from_the_header_before_decoding() -> None:
    # The pixel data is cut off: decoding would fail, so the cap error proves it came first.
    data = _encode(_picture(10, 10), "PNG")[:60]
    with pytest.raises(MediaError, match=r"10x10 = 100 pixels, over the limit of 99"):
        decode_image(data, MediaPolicy(max_image_pixels=99))
    assert decode_image(_encode(_picture(10, 10), "PNG"), MediaPolicy(max_image_pixels=100))


def test_without_a_cap_pillows_decompression_bomb_limit_holds() -> None:
    with pytest.raises(MediaError, match="decompression-bomb"):
        decode_image(_png_header(100_000, 100_000), POLICY)
    # A value above Pillow's limit does not raise it.
    with pytest.raises(MediaError, match="decompression-bomb"):
        decode_image(_png_header(100_000, 100_000), MediaPolicy(max_image_pixels=10**11))


@pytest.mark.parametrize("field,value", [("fetch_timeout", 0.0), ("max_fetch_bytes", 0),
                                         ("max_image_pixels", 0)])
def test_policy_rejects_nonsense_limits(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=">"):
        limits: dict[str, Any] = {field: value}
        MediaPolicy(**limits)


# --- image_hash ------------------------------------------------------------------------------

def test_hash_is_of_pixels_not_encoding() -> None:
    picture = _picture()
    from_png = decode_image(_encode(picture, "PNG"), POLICY)
    from_webp = load_image(_data_url(_encode(picture, "WEBP", lossless=True), "image/webp"), POLICY)
    assert from_png.tobytes() == from_webp.tobytes()
    assert image_hash(from_png) == image_hash(from_webp)
    assert len(image_hash(from_png)) == 64 and int(image_hash(from_png), 16) >= 0


def test_hash_changes_with_one_pixel_and_with_shape() -> None:
    picture = _picture()
    changed = picture.copy()
    changed.putpixel((3, 2), (1, 2, 3))
    assert image_hash(picture) != image_hash(changed)
    wide, tall = Image.new("RGB", (2, 1), RED), Image.new("RGB", (1, 2), RED)
    assert wide.tobytes() == tall.tobytes() and image_hash(wide) != image_hash(tall)


# --- file:// ---------------------------------------------------------------------------------

@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    media = tmp_path / "media"
    media.mkdir()
    (media / "img.png").write_bytes(_encode(_picture(), "PNG"))
    (tmp_path / "secret.png").write_bytes(_encode(_picture(), "PNG"))
    (media / "link.png").symlink_to(tmp_path / "secret.png")
    (media / "inner.png").symlink_to(media / "img.png")
    return media


def test_file_url_under_the_allowed_dir(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    assert load_image((media_dir / "img.png").as_uri(), policy).size == (8, 6)
    assert load_image((media_dir / "inner.png").as_uri(), policy).size == (8, 6)
    assert load_image(f"file://localhost{media_dir}/img.png", policy).size == (8, 6)


@pytest.mark.parametrize("name", ["../secret.png", "link.png", "%2e%2e/secret.png"])
def test_file_url_escapes_are_refused(media_dir: Path, name: str) -> None:
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
        load_image(f"file://{media_dir}/{name}", policy)


def test_file_url_outside_and_without_the_flag(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
        load_image((media_dir.parent / "secret.png").as_uri(), policy)
    with pytest.raises(MediaError, match="start the server with --allowed-local-media-path"):
        load_image((media_dir / "img.png").as_uri(), POLICY)


def test_file_url_missing_directory_remote_host_and_oversize(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    with pytest.raises(MediaError, match="no such file"):
        load_image((media_dir / "nope.png").as_uri(), policy)
    (media_dir / "sub").mkdir()
    with pytest.raises(MediaError, match="not a regular file"):
        load_image((media_dir / "sub").as_uri(), policy)
    with pytest.raises(MediaError, match="names host 'server'"):
        load_image(f"file://server{media_dir}/img.png", policy)
    small = MediaPolicy(allowed_local_media_path=str(media_dir), max_fetch_bytes=10)
    with pytest.raises(MediaError, match="over the 10-byte limit"):
        load_image((media_dir / "img.png").as_uri(), small)


# --- http(s) ---------------------------------------------------------------------------------

PNG = _encode(_picture(), "PNG")


class _Handler(BaseHTTPRequestHandler):
    release: threading.Event

    def do_GET(self) -> None:
        port = self.headers["Host"].rpartition(":")[2]
        if self.path == "/img.png":
            self._reply(200, PNG)
        elif self.path == "/text":
            self._reply(200, b"not a picture")
        elif self.path == "/missing":
            self.send_error(404)
        elif self.path == "/slow":
            self.release.wait(10)  # the client gives up first; teardown lets the thread go
        elif self.path == "/trickle":
            self.send_response(200)
            self.end_headers()
            try:
                while not self.release.wait(0.02):
                    self.wfile.write(b"x")
                    self.wfile.flush()
            except OSError:
                pass  # the client hung up, as it should
        elif self.path == "/big":
            self._reply(200, b"x" * 1000)
        elif self.path == "/big-unsized":
            self.send_response(200)
            self.end_headers()  # HTTP/1.0 without Content-Length: the body runs to the close
            self.wfile.write(b"x" * 1000)
        elif self.path.startswith("/redirect/"):
            self.send_response(302)
            target = self.path.removeprefix("/redirect/")
            self.send_header("Location", target.replace("PORT", port))
            self.send_header("Content-Length", "0")
            self.end_headers()

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    release = threading.Event()
    handler = type("Handler", (_Handler,), {"release": release})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # A short poll interval: shutdown() waits up to one interval for serve_forever to notice.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib sends through a proxy named in the environment, and 127.0.0.1 is not behind it."""
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def test_http_200_with_an_image(server: str) -> None:
    image = load_image(f"{server}/img.png", POLICY)
    assert image.mode == "RGB" and image.tobytes() == _picture().tobytes()


def test_http_body_that_is_not_an_image(server: str) -> None:
    with pytest.raises(MediaError, match="not an image Pillow can read"):
        load_image(f"{server}/text", POLICY)


def test_http_404_names_the_url_and_status(server: str) -> None:
    with pytest.raises(MediaError, match=r"fetching 'http://127\.0\.0\.1:\d+/missing' failed: "
                                         r"HTTP 404 Not Found"):
        load_image(f"{server}/missing", POLICY)


def test_http_timeout(server: str) -> None:
    with pytest.raises(MediaError, match=r"/slow' failed: timed out after 0\.2 s"):
        load_image(f"{server}/slow", MediaPolicy(fetch_timeout=0.2))


def test_http_timeout_bounds_the_whole_fetch(server: str) -> None:
    # Each byte arrives well within the socket timeout: only the whole-fetch deadline stops it.
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"/trickle' failed: timed out after 0\.3 s"):
        load_image(f"{server}/trickle", MediaPolicy(fetch_timeout=0.3))
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("path,why", [("/big", "is 1000 bytes, over the 100-byte limit"),
                                      ("/big-unsized", "sent more than the 100-byte limit")])
def test_http_body_over_the_byte_cap(server: str, path: str, why: str) -> None:
    with pytest.raises(MediaError, match=why):
        load_image(server + path, MediaPolicy(max_fetch_bytes=100))


def test_http_connection_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed on leaving the block: nothing listens there
    with pytest.raises(MediaError, match=rf"127\.0\.0\.1:{port}/x.png' failed: connection refused"):
        load_image(f"http://127.0.0.1:{port}/x.png", POLICY)


def test_http_dns_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_such_host(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    with pytest.raises(MediaError, match=r"host\.invalid/a\.png' failed: cannot resolve host"):
        load_image("https://no-such-host.invalid/a.png", POLICY)


def test_allowed_media_domains(server: str) -> None:
    only_example = MediaPolicy(allowed_media_domains=("example.com",))
    with pytest.raises(MediaError, match=r"host '127\.0\.0\.1' .* not in --allowed-media-domains "
                                         r"\(example\.com\)"):
        load_image(f"{server}/img.png", only_example)
    with pytest.raises(MediaError, match="not in --allowed-media-domains"):
        load_image(f"{server}/img.png", MediaPolicy(allowed_media_domains=()))
    assert load_image(f"{server}/img.png", MediaPolicy(allowed_media_domains=("127.0.0.1",)))


def test_redirects_are_checked_at_every_hop(server: str) -> None:
    local = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    assert load_image(f"{server}/redirect//img.png", local).size == (8, 6)
    with pytest.raises(MediaError, match=r"host 'localhost' .* not in --allowed-media-domains"):
        load_image(f"{server}/redirect/http://localhost:PORT/img.png", local)
    with pytest.raises(MediaError, match="redirects to a non-http"):
        load_image(f"{server}/redirect/ftp://127.0.0.1/img.png", POLICY)


@pytest.mark.parametrize("url,why", [
    ("ftp://example.com/a.png", "unsupported scheme 'ftp:'.*use http://, https://, data: or file:"),
    ("/tmp/a.png", "has no scheme"),
    ("http:///a.png", "has no host"),
])
def test_unsupported_urls(url: str, why: str) -> None:
    with pytest.raises(MediaError, match=why):
        load_image(url, POLICY)
