"""The spellings users bring from slowapi, flask-limiter and ``limits``: rate
lists, week/month/year units, and the algorithm names of other libraries."""

from __future__ import annotations

import pytest

import nanolimit
from nanolimit import Algorithm, RateLimitRule, UnknownAlgorithmError, ValidationError
from nanolimit.gateway.config import parse_rules
from nanolimit.gateway.rates import Rate, parse_rate, parse_rates, rate_rule_name

DAY = 86_400.0

# -- units -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "window"),
    [
        ("1/week", 7 * DAY),
        ("1/weeks", 7 * DAY),
        ("1/w", 7 * DAY),
        ("1/month", 2_592_000.0),
        ("1/months", 2_592_000.0),
        ("1/mo", 2_592_000.0),
        ("1/mon", 2_592_000.0),
        ("1 per 2 months", 2 * 2_592_000.0),
        ("1/year", 31_536_000.0),
        ("1/years", 31_536_000.0),
        ("1/y", 31_536_000.0),
        ("1/yr", 31_536_000.0),
        ("1/YEAR", 31_536_000.0),
        ("1/m", 60.0),  # m stays a minute, as in flask-limiter: a month is "mo"
    ],
)
def test_long_units_are_fixed_lengths(text: str, window: float) -> None:
    assert parse_rate(text) == Rate(1, window)


def test_a_month_and_a_year_are_rule_windows() -> None:
    rule = RateLimitRule.from_rate("monthly", "10000/month", algorithm="fixed_window")
    assert rule.window_seconds == 30 * DAY
    assert RateLimitRule.from_rate("yearly", "1/y").window_seconds == 365 * DAY


@pytest.mark.parametrize("text", ["1/fortnight", "1/mth", "1/yrs", "1/decade"])
def test_unknown_units_name_the_accepted_ones(text: str) -> None:
    with pytest.raises(ValidationError, match="unknown unit") as info:
        parse_rate(text)
    assert "mo (30 days)" in str(info.value) and "y (365 days)" in str(info.value)


# -- single rates keep their behaviour ---------------------------------------------


def test_parse_rate_is_unchanged_for_one_rate() -> None:
    assert parse_rate("5/minute") == Rate(5, 60.0)
    assert parse_rate("100 per 10 seconds") == Rate(100, 10.0)
    assert parse_rate("10/s burst 20") == Rate(10, 1.0, 20)
    assert parse_rate("7/500ms") == Rate(7, 0.5)


@pytest.mark.parametrize("value", [["5/minute", "100/hour"], ("5/minute",), []])
def test_parse_rate_refuses_a_list_and_points_at_parse_rates(value: object) -> None:
    with pytest.raises(ValidationError, match="parse_rates"):
        parse_rate(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["5/minute;100/hour", "5/minute, 100/hour"])
def test_parse_rate_refuses_a_rate_list_string_and_points_at_parse_rates(text: str) -> None:
    with pytest.raises(ValidationError, match="parse_rates"):
        parse_rate(text)


# -- rate lists ------------------------------------------------------------------------

MINUTE_HOUR = (Rate(5, 60.0), Rate(100, 3600.0))


@pytest.mark.parametrize(
    "text",
    [
        "5/minute;100/hour",
        "5/minute, 100/hour",
        "5/minute,100/hour",
        "5 per minute; 100 per hour",
        "  5/minute ;  100 per hour  ",
        "5 per minute, 100/hour",
    ],
)
def test_rate_list_strings(text: str) -> None:
    assert parse_rates(text) == MINUTE_HOUR


def test_mixed_separators_and_order_kept() -> None:
    assert parse_rates("1/second; 5/minute, 100/hour;1000/day") == (
        Rate(1, 1.0),
        Rate(5, 60.0),
        Rate(100, 3600.0),
        Rate(1000, DAY),
    )
    assert parse_rates("100/hour;5/minute") == (Rate(100, 3600.0), Rate(5, 60.0))


def test_one_rate_is_a_list_of_one() -> None:
    assert parse_rates("10/s burst 20") == (Rate(10, 1.0, 20),)


@pytest.mark.parametrize(
    "value",
    [
        ["5/minute", "100/hour"],
        ("5/minute", "100/hour"),
        ["5/minute;100/hour"],
        [" 5 per minute ", "100 per hour"],
    ],
)
def test_rate_list_sequences(value: list[str] | tuple[str, ...]) -> None:
    assert parse_rates(value) == MINUTE_HOUR


def test_each_item_of_a_sequence_may_be_a_list() -> None:
    assert parse_rates(["1/s; 5/minute", "100/hour, 1/month"]) == (
        Rate(1, 1.0),
        Rate(5, 60.0),
        Rate(100, 3600.0),
        Rate(1, 30 * DAY),
    )


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("5/minute;;100/hour", r"rate 2 of '5/minute;;100/hour' is empty"),
        ("5/minute;100/hour;", r"rate 3 of .* is empty"),
        (";5/minute", r"rate 1 of .* is empty"),
        ("5/minute, ,100/hour", r"rate 2 of .* is empty"),
        (["5/minute", ""], r"rate 2 of \['5/minute', ''\] is empty"),
        (["5/minute", "100/hour;"], r"rate 3 of .* is empty"),
    ],
)
def test_empty_items_are_refused_by_position(value: str | list[str], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        parse_rates(value)


@pytest.mark.parametrize("value", ["", "   ", [], (), [""], [" "]])
def test_no_rates_at_all_is_refused(value: str | list[str]) -> None:
    with pytest.raises(ValidationError, match="no rates"):
        parse_rates(value)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("5/minute;5/minute", r"rate 2 .*'5/minute', repeats '5/minute'"),
        ("5/minute, 5 per 60 seconds", r"'5 per 60 seconds', repeats '5/minute'"),
        ("5/minute;100/hour;5/m burst 9", r"rate 3 .*'5/m burst 9', repeats '5/minute'"),
        (["100/hour", "1/s;100 per hour"], r"rate 3 .*'100 per hour', repeats '100/hour'"),
    ],
)
def test_duplicates_are_the_same_limit_and_window(value: str | list[str], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        parse_rates(value)


def test_same_limit_other_window_is_no_duplicate() -> None:
    assert parse_rates("5/minute;5/hour") == (Rate(5, 60.0), Rate(5, 3600.0))


@pytest.mark.parametrize("value", ["5/minute;6/minute", "5/minute;6 per 60 seconds", "1/s;10/s burst 20"])
def test_the_same_window_with_another_limit_is_a_duplicate(value: str) -> None:
    # each window of a list is one rule, named by its window alone
    with pytest.raises(ValidationError, match="the same window twice"):
        parse_rates(value)


@pytest.mark.parametrize(
    ("window", "name"),
    [
        (60.0, "api:60s"),
        (3600, "api:3600s"),
        (0.1, "api:0.1s"),
        (1_000_000.0, "api:1000000s"),
        (1_000_001.0, "api:1000001s"),  # :g wrote both as 1e+06
        (1.5, "api:1.5s"),
    ],
)
def test_rate_rule_name_is_the_exact_window(window: float, name: str) -> None:
    assert rate_rule_name("api", window) == name
    assert RateLimitRule(name, "*", "/", "ip", "fixed_window", 1, window).name == name


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("5/minute;100/fortnight", r"rate 2 of .*'100/fortnight'.*unknown unit"),
        ("5/minute, lots", r"rate 2 of .*cannot parse rate 'lots'"),
        ("1,000/hour", r"rate 1 of .*cannot parse rate '1'"),  # no thousands separators
        (["5/minute", 5], r"item 2 of a rate list must be a str, got int"),
        (5, r"a str or a list of str, got int"),
        (b"5/minute", r"a str or a list of str, got bytes"),
        ({"5/minute"}, r"a str or a list of str, got set"),
    ],
)
def test_bad_items_are_named(value: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        parse_rates(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    ["9" * 5000 + "/minute", "5/minute burst " + "9" * 5000],
)
def test_a_count_past_python_int_digit_limit_is_a_validation_error(text: str) -> None:
    # int() refuses over 4300 digits with a bare ValueError
    with pytest.raises(ValidationError, match="digits"):
        parse_rate(text)


def test_parse_rates_is_a_root_name() -> None:
    assert nanolimit.parse_rates is parse_rates
    assert "parse_rates" in nanolimit.__all__


# -- algorithm spellings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "algorithm"),
    [
        ("fixed_window", Algorithm.FIXED_WINDOW),
        ("fixed-window", Algorithm.FIXED_WINDOW),
        ("Fixed Window", Algorithm.FIXED_WINDOW),
        ("FIXED_WINDOW", Algorithm.FIXED_WINDOW),
        ("TOKEN_BUCKET", Algorithm.TOKEN_BUCKET),
        ("token-bucket", Algorithm.TOKEN_BUCKET),
        (" Token  Bucket ", Algorithm.TOKEN_BUCKET),
        ("Leaky-Bucket", Algorithm.LEAKY_BUCKET),
        ("sliding-log", Algorithm.SLIDING_LOG),
        ("Sliding Counter", Algorithm.SLIDING_COUNTER),
        ("GCRA", Algorithm.GCRA),
        # the limits library's strategy names
        ("moving-window", Algorithm.SLIDING_LOG),
        ("moving_window", Algorithm.SLIDING_LOG),
        ("sliding-window-counter", Algorithm.SLIDING_COUNTER),
        ("Sliding Window Counter", Algorithm.SLIDING_COUNTER),
    ],
)
def test_algorithm_spellings(name: str, algorithm: Algorithm) -> None:
    assert Algorithm.parse(name) is algorithm
    assert RateLimitRule.from_rate("r", "5/minute", algorithm=name).algorithm is algorithm


@pytest.mark.parametrize("name", ["sliding-window", "Sliding Window", "sliding_window"])
def test_sliding_window_alone_is_ambiguous(name: str) -> None:
    with pytest.raises(UnknownAlgorithmError, match="ambiguous") as info:
        Algorithm.parse(name)
    message = str(info.value)
    assert "sliding_log" in message and "exact" in message
    assert "sliding_counter" in message and "approximate" in message


@pytest.mark.parametrize(
    "name", ["nope", "fixed-window-elastic-expiry", "tokenbucket", "sliding window log", "", 5, None]
)
def test_unknown_algorithms_name_every_accepted_spelling(name: object) -> None:
    with pytest.raises(UnknownAlgorithmError, match="unknown algorithm") as info:
        Algorithm.parse(name)  # type: ignore[arg-type]
    message = str(info.value)
    for accepted in (
        *(a.value for a in Algorithm),
        "moving-window",
        "sliding-window-counter",
        "fixed-window",
    ):
        assert accepted in message, accepted


def test_a_rules_file_takes_the_limits_names() -> None:
    loaded = parse_rules(
        {
            "rules": [
                {"name": "a", "rate": "5/minute", "algorithm": "moving-window"},
                {"name": "b", "rate": "5/minute", "algorithm": "Fixed Window"},
            ]
        }
    )
    assert [r.algorithm for r in loaded.rules] == [Algorithm.SLIDING_LOG, Algorithm.FIXED_WINDOW]
    with pytest.raises(ValidationError, match="ambiguous"):
        parse_rules({"rules": [{"name": "c", "rate": "5/minute", "algorithm": "sliding-window"}]})
