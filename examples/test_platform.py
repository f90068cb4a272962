"""A platform's integration test written against hostmove's pytest plugin (``hostmove.testing``, issue 20 item 7).

Installing hostmove registers the plugin; nothing here imports the project's own tests. The fixtures start the
stack, initialise a deployment with a box in ``ie`` and one in ``uk``, publish the sample app and create a host
serving on ``ie-1``; the test moves it and checks what a platform cares about.
"""

from __future__ import annotations

from hostmove.testing import Deployment


def test_a_host_moves_to_another_region_and_serves_there(hostmove_deployment: Deployment, hostmove_host: str) -> None:
    assert hostmove_deployment.serving_on(hostmove_host) == "ie-1"

    moved = hostmove_deployment.move(hostmove_host, to="uk")

    assert moved.done, moved.output
    assert hostmove_deployment.serving_on(hostmove_host) == "uk-1"
    assert moved.status["last_move"]["outcome"] == "done"
