"""A missing Kafka broker or API server skips its tests on a laptop but fails them under CI."""

from __future__ import annotations

import pytest

import conftest_infra


def test_missing_part_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="scripts/kafka.sh start"):
        conftest_infra._missing("the Kafka broker", "scripts/kafka.sh start")


def test_missing_part_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must start it"):
        conftest_infra._missing("the Kafka broker", "scripts/kafka.sh start")


def test_manifest_objects_load_in_order() -> None:
    kinds = [obj["kind"] for obj in conftest_infra.load_manifest(conftest_infra.RBAC_MANIFEST)]
    # the application's Role and its binding, then the leader-election Role in bmeg's namespace
    assert kinds == ["Namespace", "ServiceAccount", "Role", "RoleBinding", "Role", "RoleBinding"]
