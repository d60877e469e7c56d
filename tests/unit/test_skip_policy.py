"""The suite's policy for a machine that lacks what a test needs (root, namespaces, `nft`, Apache Kafka's jars):
skip with the reason on a developer's machine, fail with it under CI, which must run every bed and shaping test."""

from __future__ import annotations

import pytest

from tests.conftest import REQUIRE_APACHE_KAFKA, REQUIRE_BED, must_not_skip, unavailable


@pytest.fixture
def no_ci(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("CI", REQUIRE_BED, REQUIRE_APACHE_KAFKA):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("value", ["true", "1", "yes", "TRUE"])
def test_under_ci_nothing_is_skipped(no_ci: pytest.MonkeyPatch, value: str) -> None:
    no_ci.setenv("CI", value)
    assert must_not_skip(REQUIRE_BED) and must_not_skip(REQUIRE_APACHE_KAFKA)
    with pytest.raises(pytest.fail.Exception, match=r"^no `nft` here \(this machine must run it: CI or KBIT_REQUIRE"):
        unavailable("no `nft` here")


@pytest.mark.parametrize("value", ["", "0", "false"])
def test_a_developer_machine_skips_with_the_reason(no_ci: pytest.MonkeyPatch, value: str) -> None:
    no_ci.setenv("CI", value)
    assert not must_not_skip(REQUIRE_BED)
    with pytest.raises(pytest.skip.Exception, match=r"^shaping needs root$"):
        unavailable("shaping needs root")


def test_each_requirement_can_be_asked_for_alone(no_ci: pytest.MonkeyPatch) -> None:
    no_ci.setenv(REQUIRE_BED, "1")
    assert must_not_skip(REQUIRE_BED) and not must_not_skip(REQUIRE_APACHE_KAFKA)
    with pytest.raises(pytest.fail.Exception, match="KBIT_REQUIRE_BED=1"):
        unavailable("the multi-host test bed cannot run here; missing: root")
    with pytest.raises(pytest.skip.Exception, match="no jars"):
        unavailable("no jars", REQUIRE_APACHE_KAFKA)
