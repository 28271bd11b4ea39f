"""What the schemathesis runs share: which 400s refuse a schema-valid request for a reason no
JSON Schema can state (spared positive_data_acceptance alone; every other check still runs)."""

from __future__ import annotations


def beyond_schema(case, response, fragments: tuple[str, ...]) -> bool:
    """A 400 whose message holds one of `fragments`, or an integer field sent as 2.0: JSON
    Schema's integers include it, the server's integer fields (other than token ids) take only
    2 (tests/server/test_bad_input_hardening.py), and schemathesis spells integers both ways."""
    if response.status_code != 400:
        return False
    message = response.json()["error"]["message"]
    if any(fragment in message for fragment in fragments):
        return True
    return "Input should be a valid integer" in message and _has_whole_float(case.body)


def _has_whole_float(value) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, list) and any(_has_whole_float(v) for v in value)
