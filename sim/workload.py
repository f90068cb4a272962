"""What the operators and the apps ask of the system in one seed (model digest §2 "Actors").

Drawn once per seed from the run's plan: the hosts the console creates (each on one box, requested at
some time in the chaos phase), the wake requests that reach boxes (an app's traffic; with the
``wrong_box`` bias some reach a box that does not hold the host), and the seed's bias modes (one draw
each, model digest §8.4).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.faults import FaultPlan, Timing


@dataclass(frozen=True)
class HostPlan:
    host: str
    box: str
    region: str
    at: float  # virtual seconds: when the operator asks for it


@dataclass(frozen=True)
class WakeRequest:
    at: float
    box: str
    host: str


@dataclass(frozen=True)
class Workload:
    hosts: tuple[HostPlan, ...]
    requests: tuple[WakeRequest, ...]
    concurrent_batches: bool  # a box handles a fetched batch concurrently (FastStream PullSub(batch_size=N))
    wrong_box: bool  # some requests reach a box that does not hold the host
    marker_tail: bool  # generation.json PUTs take the long tail 1 time in 3


def draw_workload(plan: FaultPlan, boxes: dict[str, str], timing: Timing) -> Workload:
    """``boxes``: label -> region."""
    labels = sorted(boxes)
    concurrent = plan.chance("bias.concurrent_batches", 0.5)
    wrong_box = plan.chance("bias.wrong_box", 0.5)
    marker_tail = plan.chance("bias.marker_tail", 0.5)
    hosts = []
    for i in range(plan.randint("workload.hosts", 1, 3)):
        box = plan.choice("workload.host_box", labels)
        hosts.append(HostPlan(f"h{i + 1}.example", box, boxes[box], plan.uniform("workload.create_at", 0,
                                                                                  timing.chaos_s / 3)))
    requests = []
    for _ in range(plan.randint("workload.requests", 2, 10)):
        target = plan.choice("workload.request_host", hosts)
        box = target.box
        if wrong_box and plan.chance("workload.request_wrong_box", 0.3):
            box = plan.choice("workload.request_box", labels)
        requests.append(WakeRequest(plan.uniform("workload.request_at", 0, timing.chaos_s), box, target.host))
    requests.sort(key=lambda r: r.at)
    return Workload(tuple(hosts), tuple(requests), concurrent, wrong_box, marker_tail)
