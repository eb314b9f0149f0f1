"""Untrusted configuration, fuzzed: whatever a rules file or a rate string
holds, the answer is a result or a clear ValidationError naming the rule and
the field at fault, never a traceback from deep inside."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolimit import ConfigError, ValidationError, load_rules, parse_rate
from nanolimit.gateway.config import _RULE_FIELDS

# every field a rule may have, and one it may not
FIELDS = [*sorted(_RULE_FIELDS), "colour"]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        ["5/minute", "10/s burst 20", "0/s", "1/0s", "GET", "*", "/api", "api", "gcra", "ip", "user"]
    ),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
RULES = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=3)), VALUES, max_size=8)
DOCUMENTS = st.one_of(
    st.fixed_dictionaries({"rules": st.lists(RULES, max_size=5)}),
    st.dictionaries(
        st.sampled_from(["rules", "default", "stacked", "extra"]),
        st.one_of(VALUES, st.lists(RULES, max_size=3), RULES),
        max_size=4,
    ),
    st.lists(RULES, max_size=2),
    VALUES,
)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=string.printable + "µ€", max_size=40))
def test_any_rate_string_parses_or_says_why(text: str) -> None:
    try:
        rate = parse_rate(text)
    except ValidationError as exc:
        assert str(exc)
    else:
        assert rate.limit >= 1 and rate.window_seconds > 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(DOCUMENTS)
def test_any_rules_document_loads_or_names_every_fault(tmp_path, document) -> None:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(document, allow_nan=True))
    try:
        loaded = load_rules(path)
    except ConfigError as exc:
        assert exc.problems, "a ConfigError lists its problems"
        for problem in exc.problems:
            assert problem.rule and problem.field and problem.message
    else:
        assert all(rule.name for rule in loaded.rules)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_any_bytes_as_a_toml_file(tmp_path, raw: bytes) -> None:
    path = tmp_path / "rules.toml"
    path.write_bytes(raw)
    try:
        load_rules(path)
    except ConfigError as exc:
        assert exc.problems
        assert all(p.rule and p.field and p.message for p in exc.problems)


def test_a_bad_field_is_named_with_its_rule(tmp_path) -> None:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"rules": [{"name": "login", "rate": "5/minute", "scope": "planet"}]}))
    with pytest.raises(ConfigError) as caught:
        load_rules(path)
    text = str(caught.value)
    assert "login" in text and "scope" in text
