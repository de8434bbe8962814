"""Names read from the store or the command line match their whole pattern: a
trailing newline (which ``$`` lets through) is no part of any name ckptvault makes."""

from __future__ import annotations

import pytest

from ckptvault.errors import UsageError
from ckptvault.format.layout import is_generation_id, new_generation_id, parse_generation_dirname
from ckptvault.format.manifest import is_safe_file_name
from ckptvault.storage.records import check_record_key


def test_a_trailing_newline_is_refused_everywhere() -> None:
    generation_id = new_generation_id()
    assert is_generation_id(generation_id)
    assert not is_generation_id(generation_id + "\n")
    assert parse_generation_dirname(f"step-000000000001.{generation_id}") is not None
    assert parse_generation_dirname(f"step-000000000001.{generation_id}\n") is None
    assert is_safe_file_name("r00000-000.safetensors")
    assert not is_safe_file_name("r00000-000.safetensors\n")
    check_record_key("mark", "step-000000000001." + generation_id)
    with pytest.raises(UsageError):
        check_record_key("mark", "step-000000000001." + generation_id + "\n")
    with pytest.raises(UsageError):
        check_record_key("mark\n", "step-000000000001." + generation_id)
