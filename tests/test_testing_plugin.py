"""The ``hostmove.testing`` plugin is what an installed hostmove gives pytest (issue 20 item 7): its entry point, its
fixtures, and the project's own session stack is the plugin's (one stack per session, shared with ``examples/``)."""

from __future__ import annotations

from importlib import metadata

import pytest

from hostmove.stackinfo import StackInfo


def test_the_plugin_is_a_pytest11_entry_point_under_its_module_name() -> None:
    points = {ep.name: ep.value for ep in metadata.entry_points(group="pytest11")}
    assert points.get("hostmove.testing") == "hostmove.testing", points


def test_the_plugin_is_registered_once_with_its_fixtures(request: pytest.FixtureRequest) -> None:
    import hostmove.testing

    manager = request.config.pluginmanager
    assert manager.get_plugin("hostmove.testing") is hostmove.testing
    assert [p for p in manager.get_plugins() if p is hostmove.testing] == [hostmove.testing], "registered once"
    for name in ("hostmove_stack", "hostmove_deployment", "hostmove_app", "hostmove_host"):
        assert callable(getattr(hostmove.testing, name)), name


def test_the_project_s_stack_is_the_plugin_s(stack: StackInfo, hostmove_stack: StackInfo) -> None:
    assert stack is hostmove_stack
