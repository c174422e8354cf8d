"""`WeightTransferConfig` parsing: JSON text, dicts, and clear errors for everything else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ringserve.weight_transfer as wt
from ringserve.weight_transfer import WeightTransferConfig, parse_weight_transfer_config


def test_defaults_and_blank() -> None:
    assert parse_weight_transfer_config(None) is None
    assert parse_weight_transfer_config("") is None
    assert parse_weight_transfer_config("  ") is None
    config = parse_weight_transfer_config("{}")
    assert config == WeightTransferConfig(backend="shm", bucket_bytes=256 << 20)


@pytest.mark.parametrize("value", [
    '{"backend": "gloo", "bucket_bytes": 67108864}',
    {"backend": "gloo", "bucket_bytes": 64 << 20},
])
def test_text_and_dict(value: str | dict[str, object]) -> None:
    assert parse_weight_transfer_config(value) == WeightTransferConfig("gloo", 64 << 20)


def test_config_passes_through() -> None:
    config = WeightTransferConfig("nccl")
    assert parse_weight_transfer_config(config) is config


@pytest.mark.parametrize(("value", "needle"), [
    ('{"backend": 1}', "Expected `str`, got `int` - at `$.backend`"),
    ('{"backend": "tcp"}', "Invalid enum value 'tcp' - at `$.backend`"),
    ('{"bucket_bytes": 1024}', "Expected `int` >= 1048576 - at `$.bucket_bytes`"),
    ('{"bucket_bytes": "big"}', "at `$.bucket_bytes`"),
    ('{"bucket": 1}', "unknown field `bucket`"),
    ("[1, 2]", "Expected `object`, got `array`"),
    ("{backend: shm}", "not valid JSON"),
    ({"backend": None}, "at `$.backend`"),
])
def test_bad_values_name_the_field(value: str | dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_weight_transfer_config(value)
    assert needle in str(info.value)
    assert "allowed" in str(info.value) or "expected" in str(info.value)


def test_wrong_type() -> None:
    with pytest.raises(ValueError, match="expected JSON text or a dict"):
        parse_weight_transfer_config(42)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    config = WeightTransferConfig()
    with pytest.raises(AttributeError):
        config.backend = "gloo"  # type: ignore[misc]


def test_package_import_imports_no_torch() -> None:
    # The engine's configuration imports the package; what needs torch loads on first use.
    src = Path(wt.__file__).parent
    for module in ("__init__.py", "config.py", "errors.py"):
        tree = ast.parse((src / module).read_text())
        for node in tree.body:  # top level only: TYPE_CHECKING blocks are ast.If
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] != "torch", f"{module} imports {name}"
                if name.startswith("ringserve."):
                    assert name.removeprefix("ringserve.weight_transfer.") in ("config", "errors")


def test_lazy_names_resolve() -> None:
    assert sorted(dir(wt)) == sorted(wt.__all__)
    for name in wt.__all__:
        assert getattr(wt, name) is not None
    with pytest.raises(AttributeError):
        _ = wt.no_such_name
