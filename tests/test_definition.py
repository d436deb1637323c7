"""Definitions: bad input is refused at once with a FanoutError that says what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fanout import FanOut, FanoutError
from fanout.definition import _registry, get_definition, registered
from fanout.errors import DefinitionNotFound


def handler(item: Any) -> None:
    return None


def over(params: dict[str, Any]) -> list[int]:
    return [1, 2, 3]


@pytest.fixture
def scratch() -> Iterator[list[str]]:
    """Names of definitions a test registers; they are unregistered afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        _registry.pop(name, None)


def make(scratch: list[str], name: str, **kwargs: Any) -> FanOut:
    scratch.append(name)
    options: dict[str, Any] = {"over": over, "do": handler}
    options.update(kwargs)
    return FanOut(name, **options)


def test_a_definition_registers_itself_under_its_name(scratch: list[str]) -> None:
    definition = make(scratch, "scratch_ok", max_parallel=3)

    assert get_definition("scratch_ok") is definition
    assert "scratch_ok" in registered()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"do": "not a function"}, "do (the item handler) must be callable"),
        ({"do": None}, "do (the item handler) must be callable"),
        ({"over": [1, 2, 3]}, "over must be callable"),
        ({"max_parallel": 0}, "max_parallel must be an integer >= 1, got 0"),
        ({"max_parallel": -2}, "max_parallel must be an integer >= 1, got -2"),
        ({"max_parallel": True}, "max_parallel must be an integer >= 1, got True"),
        ({"max_parallel": 2.5}, "max_parallel must be an integer >= 1, got 2.5"),
        ({"max_attempts": 0}, "max_attempts must be an integer >= 1, got 0"),
        ({"failure_policy": "ignore"}, "failure_policy must be one of fail_fast, collect"),
        ({"join_mode": "most"}, "join_mode must be one of all, any, got 'most'"),
        ({"lease_seconds": 0}, "lease_seconds must be a number > 0"),
        ({"crash_budget": -1}, "crash_budget must be an integer >= 0"),
        ({"params": ["n"]}, "params must be a mapping"),
        ({"timeout": float("nan")}, "timeout must be a number > 0, got nan"),
        ({"lease_seconds": float("nan")}, "lease_seconds must be a number > 0, got nan"),
        ({"queue": ""}, "queue must be a name (1 to 200 characters), got ''"),
        ({"requires": 5}, "requires must be a name (1 to 200 characters), got 5"),
    ],
)
def test_a_definition_with_bad_settings_is_refused_with_a_clear_error(
    scratch: list[str], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(FanoutError, match="^fan-out 'scratch_bad': ") as caught:
        make(scratch, "scratch_bad", **kwargs)

    assert message in str(caught.value)
    assert "scratch_bad" not in _registry


def test_the_same_name_defined_in_two_modules_is_refused(scratch: list[str]) -> None:
    def elsewhere(item: Any) -> None:
        return None

    elsewhere.__module__ = "some.other.fanouts"

    with pytest.raises(FanoutError, match="'t_ledger' is defined twice"):
        FanOut("t_ledger", over=over, do=elsewhere)
    assert get_definition("t_ledger").module == "tests.testapp.fanouts"


def test_an_unknown_definition_name_is_a_fanout_error_that_lists_the_known_ones() -> None:
    with pytest.raises(FanoutError) as caught:
        get_definition("no_such_fanout")

    assert isinstance(caught.value, DefinitionNotFound)
    assert "unknown fan-out 'no_such_fanout'" in str(caught.value)
    assert "t_ledger" in str(caught.value)


@pytest.fixture
def typed(scratch: list[str]) -> FanOut:
    return make(scratch, "scratch_typed", params={"n": int, "label": (str, "none")})


def test_declared_params_are_converted_and_defaulted(typed: FanOut) -> None:
    assert typed.clean_params({"n": "42"}) == {"n": 42, "label": "none"}
    assert typed.clean_params({"n": 1, "label": "x"}) == {"n": 1, "label": "x"}


def test_an_unknown_param_is_refused_naming_it_and_the_known_ones(typed: FanOut) -> None:
    with pytest.raises(FanoutError) as caught:
        typed.clean_params({"n": 1, "colour": "red"})

    assert str(caught.value) == (
        "fan-out 'scratch_typed' has no param 'colour'; it takes: n, label"
    )


def test_a_missing_param_without_a_default_is_refused(typed: FanOut) -> None:
    with pytest.raises(FanoutError, match="^fan-out 'scratch_typed' needs param 'n'$"):
        typed.clean_params({"label": "x"})


def test_a_param_that_does_not_convert_is_refused_with_its_value(typed: FanOut) -> None:
    with pytest.raises(FanoutError) as caught:
        typed.clean_params({"n": "many"})

    assert "param 'n'='many' is not valid" in str(caught.value)


def test_params_that_are_not_json_are_refused(scratch: list[str]) -> None:
    free = make(scratch, "scratch_free")

    with pytest.raises(FanoutError, match="params must be JSON"):
        free.clean_params({"when": object()})


@pytest.mark.django_db
def test_starting_a_run_with_bad_params_writes_nothing(typed: FanOut) -> None:
    from fanout.models import BatchRun

    with pytest.raises(FanoutError, match="needs param 'n'"):
        typed.start({})

    assert not BatchRun.objects.exists()


def test_the_idempotency_key_is_stable_per_run_and_key() -> None:
    from fanout import Item

    first = Item(key="a", index=0, payload=None, attempt=1, run_id=7)
    retry = Item(key="a", index=0, payload=None, attempt=3, run_id=7)
    other_run = Item(key="a", index=0, payload=None, attempt=1, run_id=8)

    assert first.idempotency_key == retry.idempotency_key
    assert first.idempotency_key != other_run.idempotency_key
