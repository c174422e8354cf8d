"""The value types of the engine's command-line flags: byte sizes ("512MiB"), vLLM's
human-readable integers ("32k", "32K", "auto"), the quantization method, and `flag_type`,
which turns any of them into an argparse type. Used by `ringserve.engine.arg_utils` (and
`parse_bytes` by the HTTP layer's flags).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from ringserve.config import QUANTIZATION_CHOICES, QUANTIZATION_METHODS

_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """Parse "1073741824", "512MiB", "4G" or "1.5 GB" as a byte count (binary units).

    Raises:
        ValueError: the text is not a non-negative size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a byte size: {text!r} (examples: 1073741824, 512MiB, 4G)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def human_readable_int(text: str) -> int:
    """Parse vLLM's human-readable integers: "32768", "32k" (= 32000), "32K" (= 32768).

    As vLLM: a lowercase suffix (k, m, g, t) is decimal and takes a fraction ("25.6k" is
    25600); an uppercase one (K, M, G, T) is binary and takes whole numbers only.

    Raises:
        ValueError: not such an integer (the message says what is allowed).
    """
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", value)
    if match is None:
        raise ValueError(f"not an integer: {text!r} (examples: 32768, 32k = 32000, "
                         "32K = 32768, 25.6k)")
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise ValueError(f"not an integer: {text!r} (a fraction takes a lowercase, decimal "
                         f"suffix: {number}{suffix.lower()}, not {number}{suffix})")
    return int(number) * _BINARY_SUFFIXES.get(suffix, 1)


def human_readable_int_or_auto(text: str) -> int:
    """`human_readable_int`, or -1 for "auto" / "-1" (vLLM's spelling of "from the model")."""
    if text.strip() == "-1" or text.strip().lower() == "auto":
        return -1
    return human_readable_int(text)


def quantization_method(text: str) -> str:
    """`--quantization`'s value, checked: vLLM's other methods (awq, gptq, fp8, ...) read
    checkpoints quantized ahead of time, which ringserve does not (GGUF files aside: "gguf",
    a quantized GGUF file's default, serves them from their codes).

    Raises:
        ValueError: not one of `QUANTIZATION_CHOICES` (the message names them).
    """
    if text not in QUANTIZATION_CHOICES:
        raise ValueError(f"{text!r} is not supported: ringserve quantizes float "
                         "weights at load (weight-only, CPU); supported: "
                         f"{', '.join(QUANTIZATION_METHODS)}, and gguf (a GGUF file's own "
                         "codes, its default)")
    return text


def flag_type(parse: Any) -> Any:
    """`parse` as an argparse type: its ValueError message becomes the usage error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert
